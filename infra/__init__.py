"""What both entries (replay_grpo.py, async_pipeline.py) run on; nothing here imports either of them."""
