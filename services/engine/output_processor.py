"""What a step's sampled tokens do to their requests, and what a request reports back.

`OutputProcessor` takes each sampled token into its sequence (in place of the placeholder
an overlapped step left), decodes the text it adds from a short window of recent tokens
(`detokenizer.decode_window`; not for a request sent with `detokenize=False`),
checks the stop conditions (EOS and stop tokens, stop strings, length), and builds each
request's `RequestDelta`: what it did since its last one, holding back text a stop string
could still cut. The engine calls it on its own thread, after every step.
"""

from __future__ import annotations

from typing import Any

from services.engine.detokenizer import decode_window
from services.engine.model.tokenizer import Tokenizer
from services.engine.outputs import CompletionDelta, RequestDelta
from services.engine.scheduler import Scheduler
from services.engine.sequence import RequestGroup, SeqStatus, Sequence


class OutputProcessor:
    """Sequence updates and deltas for one engine (see the module docstring)."""

    def __init__(
        self, tokenizer: Tokenizer, scheduler: Scheduler, interventions: Any, max_model_len: int
    ):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.interventions = interventions  # the InterventionManager: finished captures
        self.max_model_len = max_model_len
        self.num_generated_tokens = 0

    def append_token(
        self,
        seq: Sequence,
        token: int,
        logprobs: dict[int, float] | None,
        readouts: dict[str, float] | None = None,
    ) -> None:
        # Runs for every token of every step: locals, not properties, where it is cheap.
        ids, pending = seq.token_ids, seq.num_pending
        if pending:  # an overlapped step: the token takes its placeholder's place
            ids[len(ids) - pending] = token
            seq.num_pending = pending = pending - 1
        else:
            ids.append(token)
        self.num_generated_tokens += 1
        if seq.unsent_logprobs is not None:
            seq.unsent_logprobs.append(logprobs or {})
        if seq.unsent_readouts is not None:
            seq.unsent_readouts.append(readouts or {})
        group = seq.group
        params = group.params
        length = len(ids) - pending  # accepted tokens, prompt included
        prev_len = len(seq.text)
        if params.detokenize:
            text, seq.prefix_offset, seq.read_offset = decode_window(
                self.tokenizer, ids, seq.prefix_offset, seq.read_offset, length,
                params.skip_special_tokens,
            )  # fmt: skip
            seq.text += text
        if token in group.eos_token_ids or token in params.stop_token_ids:
            self.scheduler.finish(seq, "stop", token)
        elif params.stop and self.check_stop_strings(seq, prev_len):
            pass
        elif length >= self.max_model_len or (
            params.max_tokens is not None and length - seq.num_prompt_tokens >= params.max_tokens
        ):
            self.scheduler.finish(seq, "length")
        if seq.num_pending and seq.is_finished:  # a token computed past the end: drop it
            del ids[-seq.num_pending :]
            seq.num_pending = 0

    def check_stop_strings(self, seq: Sequence, prev_len: int) -> bool:
        params = seq.group.params
        longest = max(len(s) for s in params.stop)
        # Only the newly decoded text (plus an overlap of a stop string's length) can hold a
        # stop string that was not there before.
        window_start = max(0, prev_len - longest + 1)
        for stop in params.stop:
            at = seq.text.find(stop, window_start)
            if at != -1:
                end = at + len(stop) if params.include_stop_str_in_output else at
                seq.text = seq.text[:end]
                self.scheduler.finish(seq, "stop", stop)
                return True
        return False

    def delta(self, group: RequestGroup) -> RequestDelta:
        """What `group` did since its last delta (and marks it sent).

        Text a stop string could still cut is held back until its sample ends (the stop
        string's length less one), so no delta's text is ever taken back: a stop string
        found now starts at or after `prev_len - longest + 1` (`_check_stop_strings`), and
        everything sent so far ends at or before that.
        """
        params = group.params
        hold = max(map(len, params.stop)) - 1 if params.stop else 0
        samples = []
        for seq in group.seqs:  # every step, for every running request: kept lean
            generated = seq.num_generated
            done = seq.status is SeqStatus.FINISHED
            if generated == seq.num_sent_tokens and (not done or seq.finish_sent):
                continue
            text = seq.text
            text_end = len(text) if done or not hold else max(seq.num_sent_chars, len(text) - hold)
            start = seq.num_prompt_tokens + seq.num_sent_tokens
            logprobs, readouts = seq.unsent_logprobs, seq.unsent_readouts
            if logprobs is not None:
                seq.unsent_logprobs = []
            if readouts is not None:
                seq.unsent_readouts = []
            samples.append(
                CompletionDelta(
                    index=seq.index,
                    token_offset=seq.num_sent_tokens,
                    token_ids=seq.token_ids[start : seq.num_prompt_tokens + generated],
                    text=text[seq.num_sent_chars : text_end],
                    logprobs=logprobs,
                    readouts=readouts,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
            seq.num_sent_tokens, seq.num_sent_chars, seq.finish_sent = generated, text_end, done
        finished = group.is_finished
        delta = RequestDelta(
            request_id=group.request_id,
            samples=samples,
            finished=finished,
            num_cached_tokens=group.num_cached_tokens or 0,
            conversation_id=params.conversation_id,
        )
        if not group.announced:
            group.announced = True
            delta.prompt, delta.prompt_token_ids = group.prompt, group.prompt_token_ids
        if group.prompt_logprobs is not None:
            delta.prompt_logprobs = group.prompt_logprobs[group.num_sent_prompt_logprobs :]
            group.num_sent_prompt_logprobs = len(group.prompt_logprobs)
        if finished:
            captured = self.interventions.captures(group)
            if captured:
                delta.captures, delta.capture_positions = captured
            elif group.params.capture:
                delta.captures, delta.capture_positions = {}, []
            iv = group.interventions
            if iv is not None:
                delta.capture_run, delta.capture_error = iv.capture_run, iv.capture_error
        return delta
