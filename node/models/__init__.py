"""Model families: one compact file each, in the spirit of nanoGPT."""
