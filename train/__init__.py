"""Training scripts for hispec exit heads (train/heads.py is the accelerate entry point)."""
