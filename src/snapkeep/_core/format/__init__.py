"""How a snapshot is named and encoded: {step} templates, manifests, codecs, checksums."""
