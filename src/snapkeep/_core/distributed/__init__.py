"""The distributed engine: snapkeep's own process groups (``groups``), agreements between ranks
(``agreement``), and sharded snapshots through ``torch.distributed.checkpoint``
(``sharded_store``, ``staging``, ``sharded``). The only part of ``_core`` that imports
``torch.distributed``.

Nothing is imported here: ``torch.distributed.checkpoint`` takes seconds to import, so only
users of distributed snapshots pay for it (import the submodules).
"""
