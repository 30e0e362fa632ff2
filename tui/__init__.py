"""`dflash-chat`: a terminal chat that shows speculative decoding at work, token by token."""
