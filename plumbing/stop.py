"""
A stop within seconds on SIGTERM (preemption) or SIGINT (Ctrl-C), whatever runs: the step under
way is left unfinished, the run (plumbing/loop.py) keeps or writes the checkpoint of the last
finished step, and every rank exits 0.

Work is of two kinds. A rank's own (a rollout, an eval's sampling, a training pass of a step's first
epoch without --fsdp; a stop after a step's first update lets it finish its epochs) runs inside
`abandonable(model)`: from the model's first forward in it, the signal handler raises Abandon where
the program is, between two Python operations (a decoder layer, a sampled token, a chunk of the
head: about a second apart for a 135M model on a 2-core CPU), and the block is left. Collective work
(all-reduces; a training pass under --fsdp, which gathers each layer from every rank) never runs
inside one, so no rank leaves a collective its peers are in.
Right after each block every rank calls `requested()`, one all-reduce: if any rank was asked to
stop, every rank leaves the step there. A signal that reaches one rank only (the others still
sampling) stops them at the end of their block.

Signals repeat: Ctrl-C reaches every process of the terminal, torchrun too, and torchrun forwards
it to its workers, which have it already. A repeat within REPEAT_S is that same stop; a signal
after that kills the process at once.
"""

import os
import signal
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

REPEAT_S = 1.0  # torchrun forwards a signal within milliseconds; pressing Ctrl-C twice takes longer


class Abandon(BaseException):
    """Raised by the signal handler inside an abandonable block. Not an Exception: code that catches
    those (chat_rl scores a user's reward that raises one 0) must not catch this."""


class StopFlag:
    """This process's stop: its handler of SIGTERM and SIGINT (plumbing/flags.run puts the previous
    ones back when the run ends), abandonable() around a rank's own work, and requested(), where
    every rank agrees."""

    def __init__(self):
        self.flag, self.first, self.armed, self.agreed = False, None, False, False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        now = time.monotonic()
        if self.first is not None:
            if now - self.first > REPEAT_S:  # a second stop: the default action, death by signal
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        self.flag, self.first = True, now
        name = signal.Signals(signum).name
        # os.write, not print: print is not safe inside a signal handler (re-entrant stdout)
        os.write(
            2,
            f"\nchat_rl: got {name}: stopping, with the last finished step "
            f"(another {name}: at once)\n".encode(),
        )
        # a signal pending as a block ends is handled as its __exit__ starts: not raised there,
        # where it would escape the with-statement; __exit__'s first line disarms
        if self.armed and frame is not None and frame.f_code is not _Abandonable.__exit__.__code__:
            self.armed = False  # one Abandon per block
            raise Abandon

    def _arm(self, module, args):
        """The first decoder layer's forward pre-hook inside an abandonable block: from here on the
        block runs no collective, so a stop may leave it (a stop asked already leaves it now)."""
        if self.flag:
            raise Abandon
        self.armed = True

    def abandonable(self, model, unless=False):
        """`with stop.abandonable(model):` around work this rank does alone from the model's first
        forward on: a stop signal leaves it (Abandon, swallowed at its end). unless=True: no."""
        return _Abandonable(self, model, unless)

    def requested(self, device):
        """Whether any rank was asked to stop; every rank calls it at one point (an all-reduce)."""
        flag = torch.tensor(float(self.flag), device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed = self.agreed or bool(flag > 0)
        return self.agreed


class _Abandonable:
    def __init__(self, stop, model, unless):
        self.stop, self.model, self.unless = stop, model, unless

    def __enter__(self):
        if not self.unless:  # prepended: before FSDP's own pre-forward hook, whose state a raise
            layer = self.model.model.layers[0]  # there would leave half set
            self.hook = layer.register_forward_pre_hook(self.stop._arm, prepend=True)

    def __exit__(self, kind, value, traceback):
        self.stop.armed = False  # first: a signal from here on waits for requested()
        if not self.unless:
            self.hook.remove()
        return kind is Abandon


class NeverStop:
    """The stop of a caller that installs no handler (evaluate() called alone): nothing to leave,
    nothing to agree on."""

    def abandonable(self, model, unless=False):
        return nullcontext()

    def requested(self, device):
        return False


NEVER = NeverStop()
