import os
import sys

# tests import the modules (chat_rl, engine, policy.gpt, ...) from the repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")       # a test that tried to download would fail, not hang
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

