"""
Why distributed.setup_distributed gives each torchrun restart its own keys, shown without chat_rl.

    python -m scripts.repro_gloo_restart [--tries=6]

Each try launches `torchrun --standalone --max-restarts=1 --nproc_per_node=2` on this file: two
gloo ranks all-reduce a few times and rank 1 SIGKILLs itself in the first launch, so torchrun
restarts the whole group with the same command line. Plain `init_process_group("gloo")` in the
restarted group reads the rank addresses the first launch left in torchrun's store and often
connects to a dead peer ("Gloo connectFullMesh failed ... Connection refused"); the same code
over a PrefixStore named after TORCHELASTIC_RESTART_COUNT finishes every time.
Prints one row per variant.
"""

import argparse
import os
import signal
import subprocess
import sys
import time


def worker(prefixed):
    import torch
    import torch.distributed as dist

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if prefixed:
        store, rank, world = next(dist.rendezvous("env://"))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"restart_{restart}", store), rank=rank, world_size=world
        )
    else:
        dist.init_process_group("gloo")
    for i in range(5):
        dist.all_reduce(torch.ones(1))
        time.sleep(0.2)
        if restart == 0 and dist.get_rank() == 1 and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank dies mid-run: torchrun restarts the group
    dist.destroy_process_group()


def main(tries):
    print(f"{'init in the restarted group':<40} {'finished':>8} {'failed':>6}")
    for prefixed in (False, True):
        ok = 0
        for _ in range(tries):
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--max-restarts=1",
                "--nproc_per_node=2",
                os.path.abspath(__file__),
                "--worker",
                str(int(prefixed)),
            ]
            ok += subprocess.run(cmd, capture_output=True, timeout=300).returncode == 0
        label = "PrefixStore per restart" if prefixed else "plain init_process_group('gloo')"
        print(f"{label:<40} {ok:>8} {tries - ok:>6}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1] == "1")
    else:
        parser = argparse.ArgumentParser(
            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        parser.add_argument("--tries", type=int, default=6, help="launches of each variant")
        main(parser.parse_args().tries)
