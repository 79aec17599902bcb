"""Every message that crosses a process on Kestrel's two channels, and the one codec for them.

The *front channel* joins a replica's front end (serve_app/engine/engine_client.py) to its
engine core (serve_app/engine/engine_core.py); the *step channel* joins the engine core to
each rank (serve_app/engine/rank_channel.py to actors/worker/step_channel.py). Both are TCP
connections carrying frames:

    frame = HEADER (WIRE_VERSION: uint16, body length: uint64, little-endian) + body
    body  = pickle (protocol 5) of one message below

The message's class says what it is: no kind strings, no positional payloads, no method
names. A connection opens with the connecting side's `Hello` (the secret the listening
actor handed out through Ray's authenticated channel), compared as bytes before anything
is unpickled, and the listener's `Ready`. A peer built from other code (another
WIRE_VERSION) is refused at its first frame header; bump WIRE_VERSION whenever a message
here or a type it carries (StepPlan, StepOutput, RowProcessing: actors/protocol/step_plan.py;
SamplingParams: actors/protocol/sampling_params.py) changes its fields.

    step channel    core -> rank:  Hello, then StepPlan per step
                    rank -> core:  Ready, then StepOutput or StepFailed per plan, in order
    front channel   front -> core: Hello, then AddRequest, FinishRequest, GrammarVocab, StatsQuery
                    core -> front: Ready, then Outputs (one per step), StatsReply, Rejected,
                                   RanksFailed
"""
from __future__ import annotations

import asyncio
import enum
import pickle
import socket
import struct
from dataclasses import dataclass, field, fields
from itertools import starmap
from operator import attrgetter
from typing import Any

from actors.protocol.sampling_params import SamplingParams
from actors.protocol.step_plan import StepOutput, StepPlan

WIRE_VERSION = 1
HEADER = struct.Struct("<HQ")  # WIRE_VERSION, body length
MAX_FRAME = 1 << 30  # a 4096-token prefill plan is tens of KB; anything near this is garbage


class WireError(ConnectionError):
    """A frame this code cannot read: another wire version, an absurd length, or a message
    that does not belong on the channel. The connection cannot go on."""


# ---- both channels -------------------------------------------------------------------------
@dataclass
class Hello:
    """The first frame from the connecting side: the listener's secret."""
    token: str


@dataclass
class Ready:
    """The listener's answer to a matching Hello."""


# ---- step channel ------------------------------------------------------------------------
@dataclass
class StepFailed:
    """A plan the rank could not run. `message` may reach clients (it names no exception
    class); `traceback` is for the engine core's log."""
    message: str
    traceback: str


# ---- front channel -----------------------------------------------------------------------
@dataclass
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # built and checked by the front end; not rebuilt in the core
    rank: int | None  # None under dp_attention: the core places it by the ranks' loads


@dataclass
class FinishRequest:
    """End a request: "stop" (the front end saw a stop string) or "abort" (its client left)."""
    rid: str
    reason: str


@dataclass
class GrammarVocab:
    """xgrammar's tokenizer info, serialized, once before the first request with a grammar;
    None when the ranks were given it at start-up."""
    vocab_json: str | None


class Stats(enum.Enum):
    KV = "kv"  # per rank: free and total KV slots
    RANKS = "ranks"  # per rank: requests, scheduler counters, step phases and counts
    ENGINE = "engine"  # the ranks summed


@dataclass
class StatsQuery:
    call_id: int
    stats: Stats


@dataclass
class StatsReply:
    call_id: int
    value: Any


@dataclass
class Rejected:
    """A request the core would not take (the front end's checks should have caught it)."""
    rid: str
    message: str


@dataclass
class RanksFailed:
    """A rank's step loop failed (None: every rank's, under dp_attention); its requests end
    with `message`."""
    rank: int | None
    message: str


@dataclass
class RequestOutput:
    """One request's news from one step: from the scheduler to its caller (the in-process
    engine's), and in the served engine from the core to the request's stream."""
    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    accept_lengths: list[int] = field(default_factory=list)  # new ones since the last output
    cached_tokens: int = 0  # prompt tokens the prefix cache held at the request's admission
    logprobs: list | None = None  # per new token: (logprob, top ids, top logprobs), if asked
    # With the first output of a request that asked: per prompt token, None for the first,
    # then (logprob, top ids, top logprobs, rank) (actors/sampling/logprobs.py).
    prompt_logprobs: list | None = None


_output_values = attrgetter(*(f.name for f in fields(RequestOutput)))


def _outputs(rows: list[tuple]) -> "Outputs":
    return Outputs(list(starmap(RequestOutput, rows)))


@dataclass
class Outputs:
    """Every request's outputs of one step, in one frame."""
    outputs: list[RequestOutput]

    def __reduce__(self):
        # Each output as its values in field order, rebuilt by RequestOutput's own
        # constructor: pickled as objects, 256 outputs cost twice as long each way.
        return _outputs, (list(map(_output_values, self.outputs)),)


# What each end decodes (a Hello is compared as bytes, never decoded).
RANK_RECEIVES = (StepPlan,)
CORE_RECEIVES_FROM_RANK = (Ready, StepOutput, StepFailed)
CORE_RECEIVES_FROM_FRONT = (AddRequest, FinishRequest, GrammarVocab, StatsQuery)
FRONT_RECEIVES = (Ready, Outputs, StatsReply, Rejected, RanksFailed)


# ---- the codec ---------------------------------------------------------------------------
def encode(message: Any) -> bytes:
    """One frame: header and body."""
    body = pickle.dumps(message, protocol=5)
    return HEADER.pack(WIRE_VERSION, len(body)) + body


def body_length(header: bytes) -> int:
    """The length of the body behind `header`; WireError for another version or a garbage size."""
    version, n = HEADER.unpack(header)
    if version != WIRE_VERSION:
        raise WireError(f"the peer speaks wire version {version}, this process {WIRE_VERSION}: "
                        "both ends must run the same Kestrel")
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes")
    return n


def decode(body: bytes, accepted: tuple[type, ...]) -> Any:
    """The message in `body`; WireError unless it is one of `accepted`."""
    message = pickle.loads(body)
    if not isinstance(message, accepted):
        raise WireError(f"unexpected {type(message).__name__} on this channel")
    return message


async def read_message(reader: asyncio.StreamReader, accepted: tuple[type, ...]) -> Any:
    """The next message from an asyncio stream (IncompleteReadError when it closed)."""
    n = body_length(await reader.readexactly(HEADER.size))
    return decode(await reader.readexactly(n), accepted)


async def open_channel(host: str, port: int, token: str, accepted: tuple[type, ...]
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The connecting side of either channel: connect, say Hello with `token`, wait for Ready."""
    reader, writer = await asyncio.open_connection(host, port)
    sock = writer.get_extra_info("socket")
    if sock is not None:  # frames are small and each is awaited: no Nagle delay
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    writer.write(encode(Hello(token)))
    answer = await read_message(reader, accepted)
    if not isinstance(answer, Ready):
        raise ConnectionError(f"the peer answered the hello with {type(answer).__name__}")
    return reader, writer
