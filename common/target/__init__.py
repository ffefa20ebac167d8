"""What we read of the target: the capture convention and the capture of hidden states (HF: capture.py;
02b's SGLang model runner: sglang_capture.py), the target's embedding and lm_head, and the feature shards
02b writes and 03/04 read, with the 02b and 03 manifests as their readers take them (manifests.py).
Imports only the stage contract."""
