import os
import sys

# tests import the flat modules (gpt, engine, chat_rl, ...) from the repo root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")       # a test that tried to download would fail, not hang
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def pytest_configure(config):
    # torch.compile's own imports (the compiled-decode test) trip a deprecation inside torch.jit: not ours to fix
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
