"""Checkpoint side of the adapters: read HF checkpoints in every supported format into dense
weights plus a packed host expert bank; synthesize checkpoints; build the real tokenizer."""
