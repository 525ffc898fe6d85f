import os
import sys

# tests import the modules (chat_rl, engine, policy.gpt, ...) from the repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# torch's threads busy-wait otherwise: beside other work a run slows several times (as chat_rl.py
# sets it too); read when torch loads, which no test module has yet
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a test that tried to download would fail, not hang
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
