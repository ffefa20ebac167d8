"""What we read of the target: the capture convention and HF capture of hidden states, the target's
embedding and lm_head, and the feature shards 02b writes and 03/04 read. Imports only the stage
contract."""
