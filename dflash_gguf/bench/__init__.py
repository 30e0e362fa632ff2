"""dflash-bench: plain decoding against DFlash on the same target, prompts and settings."""
