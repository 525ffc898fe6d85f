"""
Tool calls inside a batched decode, in GSM8K's annotation syntax: when a row's text ends in
`<<expression=`, the tool (calculator.calculate) evaluates the expression and the row's next tokens
are its result and `>>`, forced: the engine feeds them in place of what the row samples, and marks
them 0 in the mask (never trained on, never counted by the loss). The model then writes on, as
GSM8K's solutions do (`48/2 = <<48/2=24>>24 clips`).

Tokenizer-agnostic: with byte-level BPE, `<<`, `=` and `>>` merge with their neighbours (`$<<`,
`)=`), so calls are spotted on the text, character by character, by a three-state automaton:

    OUT --'<'--> LT --'<'--> IN --'='--> OUT, a call if the '=' ends its token
                 LT --other--> OUT          IN --newline or '>'--> OUT (an annotation is one line)
                                            IN --'<'--> LT (`<<<` ends at LT, `<<<<` IN:
                                                            an even run opens a call)

Each token's effect on the automaton is a (vocabulary, 3) table built once per tokenizer, so at
each position the engine looks a row's next state up on the device: rows that are not calling
cost no Python work. A '=' followed by more text in the same token (BPE's `=$`) means the model
wrote a result itself: no call. A position where some rows call the tool costs one more host
sync for all of them together, and their result tokens wait in a (rows, MAX_FORCED) queue on
the device, fed one per position.
A refused expression (calculate returns None: `<<2+x=`, `<<7//2=`) forces nothing: the row goes on
as it would with no tool at all, writing its own result, and the refusal is counted (`errors`).
A row that opens `<<` and never writes `=` simply continues.
"""

import torch

OUT, LT, IN = 0, 1, 2  # outside a call, after one '<', inside `<<...` before its '='
# tokens of one result and its ">>"; the calculator's results are at most 40 characters
MAX_FORCED = 64


def _run(text, state):
    """(state after text, whether text ends a call) for the automaton above, starting from state."""
    fired = False
    for ch in text:
        fired = False
        if state == IN:
            if ch == "=":
                state, fired = OUT, True
            elif ch in "\n>":
                state = OUT
            elif ch == "<":
                state = LT
        elif ch == "<":
            state = IN if state == LT else LT
        else:
            state = OUT
    return state, fired


def call_tables(tokenizer, device):
    """next_state, fires: (vocab, 3) tables of each token's effect from each state. Special
    tokens decode to '': they change nothing."""
    vocab = tokenizer.vocab_size
    next_state, fires = (
        torch.zeros(vocab, 3, dtype=torch.long),
        torch.zeros(vocab, 3, dtype=torch.bool),
    )
    for token in range(vocab):
        text = tokenizer.decode([token])
        for state in (OUT, LT, IN):
            next_state[token, state], fires[token, state] = _run(text, state)
    return next_state.to(device), fires.to(device)


class ToolCalls:
    """
    The call state of one Engine.generate call's rows (B of them), all on the device, in batch
    order (permuted with the rows when the batch is compacted: keep_rows), plus, on the host,
    the calls and refusals of each original row.
    """

    def __init__(self, tool, tokenizer, tables, num_rows, device):
        self.tool, self.tokenizer = tool, tokenizer
        self.next_state, self.fires = tables
        self.state = torch.zeros(num_rows, dtype=torch.long, device=device)
        # position of the token with the call's first '<'
        self.opened_at = torch.zeros(num_rows, dtype=torch.long, device=device)
        # a row's result tokens to feed, how many, and the next one to feed
        self.queue = torch.zeros(num_rows, MAX_FORCED, dtype=torch.long, device=device)
        self.queue_len = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.queue_pos = torch.zeros(num_rows, dtype=torch.long, device=device)
        # per original row: calls made, and of them refused
        self.calls, self.errors = [0] * num_rows, [0] * num_rows

    def feed(self, t, token, running):
        """
        token (B,) as sampled at position t -> (token with forced tokens in place,
        forced (B,) bool, called (B,) bool): called = the row's token ended a call (the result
        is forced from position t + 1, once answer() has run).
        """
        forced = self.queue_pos < self.queue_len
        pending = self.queue.gather(1, self.queue_pos.clamp(max=MAX_FORCED - 1)[:, None])[:, 0]
        token = torch.where(forced, pending, token)
        self.queue_pos += forced
        # the automaton reads every token, forced ones too (a result and ">>" leave it OUT)
        before = self.state
        self.state = self.next_state[token, before]
        self.opened_at = torch.where((before == OUT) & (self.state != OUT), t, self.opened_at)
        # a finished row still in the batch writes nothing that counts
        called = self.fires[token, before] & running
        return token, forced, called

    def answer(self, t, called, n_called, row_ids, out):
        """
        Run the tool for the n_called rows whose token ended a call at position t (one host sync
        for all of them): decode each row's text from its call's first '<' (out[s, row] is
        original row `row`'s token s; row_ids: each batch slot's original row), take what follows
        the last '<<' up to the '=', and queue the result and '>>' as the row's next tokens.
        """
        # the calling slots first, in order, without nonzero (whose size the host would wait for)
        slots = torch.argsort((~called).to(torch.uint8), stable=True)[:n_called]
        # one read for all: each row's slot, its call's first position, original row, tokens
        table = [slots, self.opened_at[slots], row_ids[slots]]
        table = torch.cat([torch.stack(table, dim=1), out[: t + 1, row_ids[slots]].T], dim=1)
        answered, queued, queue_lens = [], [], []
        for slot, start, row, *span in table.tolist():
            text = self.tokenizer.decode(span[start:])
            result = self.tool(text[text.rfind("<<") + 2 : -1])
            self.calls[row] += 1
            if result is None:
                self.errors[row] += 1
                continue
            ids = self.tokenizer.encode(result + ">>")
            assert len(ids) <= MAX_FORCED, f"a tool result of {len(ids)} tokens: raise MAX_FORCED"
            answered.append(slot)
            queued.append(ids + [0] * (MAX_FORCED - len(ids)))
            queue_lens.append(len(ids))
        if answered:  # one copy to the device for all of this position's answers
            device = self.queue.device
            index = torch.tensor(answered, device=device)
            self.queue[index] = torch.tensor(queued, device=device)
            self.queue_len[index] = torch.tensor(queue_lens, device=device)
            self.queue_pos[index] = 0

    def keep_rows(self, order):
        """The batch was compacted: slot i now holds old slot order[i]."""
        for name in ("state", "opened_at", "queue", "queue_len", "queue_pos"):
            setattr(self, name, getattr(self, name)[order])
