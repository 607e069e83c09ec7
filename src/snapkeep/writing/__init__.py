"""Snapshot writers with pytorch-pfn-extras' names and signatures (``ppe.writing``).

=======================  ==========================================  ===================
writer                   where the save runs                         in flight (default)
=======================  ==========================================  ===================
``SimpleWriter``         caller's thread; returns when durable       -
``ThreadWriter``         a thread per snapshot                       1
``ProcessWriter``        one persistent ``spawn`` worker process     1
``ThreadQueueWriter``    one consumer thread fed by a bounded queue  2
``ProcessQueueWriter``   consumer thread -> persistent worker        2
=======================  ==========================================  ===================
"""

from typing import Any

from snapkeep._not_shipped import not_shipped_error
from snapkeep.writing._base import SimpleWriter, Writer
from snapkeep.writing._parallel import ProcessWriter, RemoteSave, ThreadWriter
from snapkeep.writing._ppe_fs import PpeFileSystem
from snapkeep.writing._queue import ProcessQueueWriter, QueueWriter, ThreadQueueWriter
from snapkeep.writing._standard import StandardWriter

__all__ = [
    "Writer",
    "SimpleWriter",
    "StandardWriter",
    "ThreadWriter",
    "ProcessWriter",
    "RemoteSave",
    "QueueWriter",
    "ThreadQueueWriter",
    "ProcessQueueWriter",
    "PpeFileSystem",
]


def __getattr__(name: str) -> Any:
    # ppe's TensorBoardWriter is not shipped: the error says so and points to the plug-in path
    raise not_shipped_error(__name__, name)
