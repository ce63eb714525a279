"""Loaded by pytest before any test module (the smoke test and tests/), so before torch: OpenMP's threads wait
passively, as replay_grpo.py sets for the CLI (libgomp reads the policy once, when torch loads it; spin-waiting
threads beside another busy process made the smoke test 7x slower on 2 cores). A value already set is kept."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
