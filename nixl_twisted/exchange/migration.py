"""Decode migrations: an answer whose decode instance fails mid-answer, continued on another.

``Migrations`` is one completion's, made by the exchange while
``--decode-migrations`` is on. It gives each decode leg what stands between
its answer and the client (``protocol.transcript``), and when the leg
breaks (``broken.Break``) says whether the request moves, and as what
completion: the request itself while the client has nothing of the answer,
else the prompt and the tokens relayed, as ids, with what is left to
generate (``protocol.resumable``). At most ``--decode-migrations`` moves, none
once the request is ``--migration-deadline`` seconds old; each is counted
(``nixlproxy_migrations_total{outcome}``), told in the access event (both
decode instances and the token it moved at) and in the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.backends.instances import Instance
from nixl_twisted.config.parts import MigrationRules
from nixl_twisted.config.words import counted
from nixl_twisted.exchange.broken import Break
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import RequestTrace
from nixl_twisted.protocol import resumable, routes
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.held import Opening, Whole
from nixl_twisted.protocol.lowering import JSONObject
from nixl_twisted.protocol.transcript import PROMPT_MISMATCH, Transcript

log = Logger()

#: Why a part of a batched completion never moves: the batch merges what it writes.
BATCH = "batch"


@dataclass(frozen=True)
class Moved:
    """The answer moves to another decode instance: ``continuation`` continues it, and
    ``failed`` is the instance to avoid (None: the continuation failed before any decode
    instance had it)."""

    continuation: Completion
    failed: Instance | None


class NextLeg(Enum):
    """What the next decode leg's answer is to the client."""

    #: The request's own answer: nothing has moved.
    FIRST = "first"
    #: A continuation the client has nothing of: its headers are the client's first.
    AFRESH = "afresh"
    #: A continuation of what the client has: its headers and its opening are not relayed.
    RESUMING = "resuming"


class Migrations:
    """One completion's moves: what each decode leg is relayed through, and whether a break
    moves it, and as what."""

    def __init__(
        self,
        completion: Completion,
        rules: MigrationRules,
        clock: IReactorTime,
        metrics: ProxyMetrics,
        record: AccessRecord,
        trace: RequestTrace,
        refused: str | None = None,
    ) -> None:
        """``refused``: why it never moves, besides what its body says (a batch's part)."""
        self.completion = completion
        self.rules = rules
        self.clock = clock
        self.metrics = metrics
        self.record = record
        self.trace = trace
        resumable = completion.resumable
        #: Why it never moves (None: it may), and why only before its first token.
        self.refused = refused or resumable.refused
        self.from_start = resumable.from_start
        #: Its decode legs are asked for the ids of the tokens they stream (an attribute:
        #: read several times a request).
        self.tracked = self.refused is None and self.from_start is None
        self._deadline = clock.seconds() + rules.deadline if rules.deadline else None
        self.tries = 0
        #: What the decode leg relayed now stands behind (a tracked stream's transcript).
        self._filter: Transcript | Opening | Whole | None = None
        #: The client has part of the answer: legs from now on continue it.
        self._resuming = False
        #: What the next decode leg's answer is to the client (a plain attribute: read on
        #: every request).
        self.leg = NextLeg.FIRST
        #: The last break, whose end is the request's if no continuation serves it.
        self._broke: Break | None = None
        #: A continuation is out: the completion, where and at which token it moved,
        #: and the decode instance it went to.
        self._continuing: Completion | None = None
        self._from = ("", 0)
        self._to: Instance | None = None
        #: When it moved, and how long its continuation took to its first byte.
        self._since = 0.0
        self._took: float | None = None
        #: The prompt tokens its first prefill found cached, as its handoff said.
        self._cached: int | None = None
        #: The request's own prompt ids, which a continuation starts from: as given, or as
        #: its first prefill answered them (None: unknown; never a decode answer's).
        given = completion.token_ids
        self.prompt: list[int] | None = list(given) if given else None

    def filtered(self) -> Transcript | Opening | Whole | None:
        """What stands between the next decode leg's answer and the client (None: nothing:
        the answer never moves)."""
        if self.refused is not None:
            return None
        if self.tracked:
            transcript = self._filter
            if isinstance(transcript, Transcript) and self._resuming:
                transcript.resume(self._cached)
            else:
                chat = self.completion.path == routes.CHAT_COMPLETIONS
                strip = self.completion.body.get("return_token_ids") is not True
                self._filter = Transcript(chat, strip)
        elif self.completion.stream:
            opening = self._filter.opening if isinstance(self._filter, Opening) else ()
            self._filter = Opening(opening if self._resuming else ())
        else:
            self._filter = Whole()
        return self._filter

    def handed(self, params: JSONObject, prompt: list[int] | None = None) -> None:
        """The first prefill's params: the cached prompt tokens the answer's usage says
        (vLLM's decode says ``remote_prefill_cached_tokens``), whoever finishes it; and the
        prompt's ids it answered (``prompt``), the request's own unless it gave them."""
        cached = params.get("remote_prefill_cached_tokens")
        if type(cached) is int and not self.tries:
            self._cached = cached
        if prompt is not None and self.prompt is None and not self.tries:
            self.prompt = prompt

    def sent_to(self, instance: Instance) -> None:
        """A continuation's decode leg went to ``instance``."""
        if self._continuing is not None:
            self._to = instance

    def first_byte(self) -> None:
        """The continuation out answered its first byte: the time the move took, from the
        break (``nixlproxy_migration_seconds``, and the access event)."""
        if self._continuing is not None and self._took is None:
            self._took = self.clock.seconds() - self._since
            self.metrics.migration_seconds.observe(self._took)

    def movable(self) -> bool:
        """Whether a break now would move the request (nothing counted, nothing said)."""
        if self.refused is not None or self.tries >= self.rules.limit:
            return False
        if self._deadline is not None and self.clock.seconds() >= self._deadline:
            return False
        passed = self._filter
        if passed is None or not passed.passed:
            return True
        if isinstance(passed, Opening):
            return not passed.tokens
        return isinstance(passed, Transcript) and not isinstance(self._from_here(passed), str)

    def _from_here(self, transcript: Transcript) -> tuple[list[int], int] | str:
        """The continuation's prompt ids and the tokens relayed, or why there is none (a
        continuation that may generate nothing more is none: vLLM refuses ``max_tokens`` 0)."""
        found = transcript.continuation(self.prompt)
        if isinstance(found, str):
            return found
        if resumable.spent(self.completion.path, self.completion.body, found[1]):
            return "max_tokens_reached"
        return found

    def move(self, broke: Break, instance: Instance) -> Moved | None:
        """What continues the request after ``broke`` on ``instance``, or None: it ends as
        without migrations (``broke.end``; the access event says why)."""
        self._concluded("failed")
        self._broke = broke
        if self.refused is not None:
            self._stays("refused", self.refused)
            return None
        filtered = self._filter
        passed = filtered is not None and filtered.passed
        relayed, continued = 0, self.completion
        if isinstance(filtered, Transcript) and passed:
            found = self._from_here(filtered)
            if isinstance(found, str):
                if found == PROMPT_MISMATCH:
                    log.warn(
                        "decode instance {url} answered {request_id} for other prompt token "
                        "ids than the request's: its answer is not continued",
                        url=broke.url,
                        request_id=self.completion.request_id,
                    )
                self._stays("refused", found)
                return None
            prompt, relayed = found
            continued = self.completion.continued(prompt, relayed)
        elif passed and (not isinstance(filtered, Opening) or filtered.tokens):
            # (a stream past its first token, a whole answer past what is held)
            self._stays("refused", self.from_start)
            return None
        if not self._may():
            return None
        self._resuming = passed
        return Moved(self._out(broke.url, relayed, continued), instance)

    def again(self) -> Moved | Break | None:
        """A continuation's legs failed before its answer came: the same once more
        (``Moved``), else the break the request then ends with (``Break.end``); None: no
        continuation was out, the failure is the answer's own."""
        continuing, (source, relayed), to = self._continuing, self._from, self._to
        if continuing is None:
            return None
        self._concluded("failed")
        if not self._may():
            assert self._broke is not None  # (a continuation is out only after a break)
            return self._broke
        return Moved(self._out(source, relayed, continuing), to)

    def completed(self) -> None:
        """The answer ended whole: the continuation out, if any, did it."""
        if self._continuing is not None:  # (else nothing to say: most answers never move)
            self._concluded("completed")

    def _may(self) -> bool:
        """Another move is allowed: tries left, and the request not past its deadline."""
        if self.tries >= self.rules.limit:
            self._stays("exhausted")
            return False
        if self._deadline is not None and self.clock.seconds() >= self._deadline:
            self._stays("past_deadline")
            return False
        return True

    def _out(self, source: str, relayed: int, continued: Completion) -> Completion:
        self.tries += 1
        self._continuing, self._from, self._to = continued, (source, relayed), None
        self.leg = NextLeg.RESUMING if self._resuming else NextLeg.AFRESH
        self._since, self._took = self.clock.seconds(), None
        self.trace.moving(self.tries, relayed, source)
        log.warn(
            "decode for {request_id} failed after {relayed} on {url}: moving it to "
            "another decode instance ({tries} of {limit})",
            request_id=self.completion.request_id,
            tokens=relayed,
            relayed=counted(relayed, "token"),
            url=source,
            tries=self.tries,
            limit=self.rules.limit,
        )
        return continued

    def _stays(self, outcome: str, why: str | None = None) -> None:
        """No move: counted, and said in the access event."""
        self.metrics.child(self.metrics.migrations, outcome).inc()
        self.record.migration = outcome if why is None else f"{outcome} ({why})"

    def _concluded(self, outcome: str) -> None:
        """The continuation out, if any, ended so."""
        if self._continuing is None:
            return
        self.metrics.child(self.metrics.migrations, outcome).inc()
        (source, relayed), to = self._from, self._to.url if self._to else "none"
        took = "" if self._took is None else f" ({round(self._took * 1000)} ms)"
        self.record.migrations.append(f"{source}@{relayed} -> {to} {outcome}{took}")
        self._continuing = None
