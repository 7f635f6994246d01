"""Attention metadata of one step in the flattened-token layout (``docs/design.md``).

Shapes (``num_tokens`` is the token dim, ``num_reqs`` the request dim):

===================== ======= ===========================
field                 dtype   shape
===================== ======= ===========================
query_start_loc       int32   [num_reqs + 1]
seq_lens              int32   [num_reqs]
num_computed_tokens   int32   [num_reqs]
block_table           int32   [num_reqs, max_blocks]
slot_mapping          int64   [num_tokens]  (-1 = padding token, writes nothing)
max_query_len         int     host int
max_seq_len           int     host int
===================== ======= ===========================

Request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``; they are the last
``query_len`` positions of its sequence of ``seq_lens[i]`` tokens, so
``num_computed_tokens[i] == seq_lens[i] - query_len``. Tokens past ``query_start_loc[-1]`` are
padding.

Host mirrors
------------
Each tensor field may come with a copy on the host, ``<field>_cpu`` (same dtype and shape, on
the CPU; vLLM's ``query_start_loc_cpu``, ``seq_lens_cpu``, ``num_computed_tokens_cpu``), which
a scheduler has anyway: it builds the metadata there before copying it to the GPU. Everything
the runtime decides on the host (the checks, the DP vote, the prefix-read veto, the ubatch
split) then reads the mirrors instead of the device tensors, each read of which is a host sync
on CUDA:

- with the mirrors of ``query_start_loc``, ``seq_lens`` and ``num_computed_tokens``, no count is
  read from the device (:meth:`AttentionMetadata.host_counts`); without them, the three are
  read in one copy;
- with those of ``slot_mapping`` and ``block_table`` as well, the prefix-read veto reads nothing
  either (:func:`~dbo_compile.runtime.vetoes.prefix_read_veto`); without, one copy.

A mirror is trusted to hold the device tensor's values: that is not checked, since checking it
is the read it saves. What the host can check cheaply is checked on every validation (device,
dtype, shape against the device field; the relations between the counts; the engine's
``num_scheduled_tokens`` against ``query_start_loc_cpu``), and
:meth:`AttentionMetadata.check_host_mirrors` compares the values with the device (the option
``check_host_mirrors`` of ``DboConfig`` runs it every step; for debugging).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from dbo_compile.errors import MetadataError

#: Which dim of each tensor field is indexed by what; read by the backend to know which graph
#: inputs are token-indexed (sliced) and which are request-indexed (re-built per ubatch).
FIELD_LAYOUT: dict[str, str] = {
    "query_start_loc": "request",
    "seq_lens": "request",
    "num_computed_tokens": "request",
    "block_table": "request",
    "slot_mapping": "token",
}

#: dtype of each tensor field (and of its host mirror ``<field>_cpu``).
FIELD_DTYPE: dict[str, torch.dtype] = {
    "query_start_loc": torch.int32,
    "seq_lens": torch.int32,
    "num_computed_tokens": torch.int32,
    "block_table": torch.int32,
    "slot_mapping": torch.int64,
}

#: the counts every step's host decisions need, in :meth:`AttentionMetadata.host_counts` order.
_COUNTS = ("query_start_loc", "seq_lens", "num_computed_tokens")

#: ``(query_start_loc [R+1], seq_lens [R], num_computed_tokens [R])`` on the host, each a list of
#: ints or a CPU integer tensor (:meth:`AttentionMetadata.host_counts`, ``host_fields``).
HostCounts = tuple[Union[Sequence[int], torch.Tensor], Union[Sequence[int], torch.Tensor],
                   Union[Sequence[int], torch.Tensor]]


def query_lens_from(query_start_loc: Sequence[int] | torch.Tensor) -> list[int]:
    """Query lens (tokens per request) from host ``query_start_loc`` offsets ``[R+1]`` (a list
    of ints or a CPU tensor)."""
    if isinstance(query_start_loc, torch.Tensor):
        return (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    return [b - a for a, b in zip(query_start_loc, query_start_loc[1:])]


def int_list(values: Sequence[int] | torch.Tensor) -> list[int]:
    """Host counts (e.g. ``num_scheduled_tokens``) as a list of Python ints; a tensor is read
    with one ``tolist``."""
    return list(map(int, values.tolist() if isinstance(values, torch.Tensor) else values))


def host_tensor(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Host counts as a CPU integer tensor (lists are converted: slow for long lists)."""
    if isinstance(values, torch.Tensor):
        return values
    return torch.tensor(values, dtype=torch.int64)


@dataclass
class AttentionMetadata:
    """Per-step attention metadata; see the module docstring for shapes, dtypes and the host
    mirrors (``<field>_cpu``: optional, ``None`` = not given)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    num_computed_tokens_cpu: torch.Tensor | None = None
    block_table_cpu: torch.Tensor | None = None
    slot_mapping_cpu: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Rows of the token dim, padding included."""
        return int(self.slot_mapping.shape[0])

    @property
    def num_actual_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The device tensor fields by name (not the host mirrors)."""
        return {name: getattr(self, name) for name in FIELD_LAYOUT}

    def mirror(self, name: str) -> torch.Tensor | None:
        """The host mirror of tensor field ``name`` (``None``: not given)."""
        return getattr(self, f"{name}_cpu")

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """The tensor fields moved to ``device``; the host mirrors stay as they are."""
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def with_host_mirrors(self) -> AttentionMetadata:
        """A copy whose every tensor field has its host mirror: the given ones, the others
        copied from the device here (one read each; a scheduler that builds the metadata on the
        host passes its own CPU tensors instead)."""
        return dataclasses.replace(self, **{
            f"{k}_cpu": self.mirror(k) if self.mirror(k) is not None else v.to("cpu", copy=True)
            for k, v in self.tensors().items()})

    def host_counts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query_start_loc`` ``[R+1]``, ``seq_lens`` and ``num_computed_tokens`` ``[R]`` on the
        host, as CPU integer tensors: their host mirrors when all three are given (no device
        read), else read from the device in one copy (a host sync on CUDA)."""
        mirrors = tuple(self.mirror(k) for k in _COUNTS)
        if all(m is not None for m in mirrors):
            return mirrors  # type: ignore[return-value]
        r = self.num_reqs
        fields = tuple(getattr(self, k) for k in _COUNTS)
        if len({t.device for t in fields}) == 1 and len({t.dtype for t in fields}) == 1:
            flat = torch.cat([t.reshape(-1) for t in fields]).cpu()
            return flat[:r + 1], flat[r + 1:2 * r + 1], flat[2 * r + 1:]
        return tuple(t.cpu() for t in fields)  # type: ignore[return-value]

    def host_fields(self) -> tuple[list[int], list[int], list[int]]:
        """:meth:`host_counts` as lists of ints (no device read with the host mirrors, else one
        copy)."""
        return tuple(t.tolist() for t in self.host_counts())  # type: ignore[return-value]

    def check_host_mirrors(self) -> None:
        """Compare every given host mirror with its device tensor (reads each from the device:
        for debugging; the option ``check_host_mirrors`` of ``DboConfig`` runs it every step).

        Raises:
            MetadataError: a mirror's values differ (naming the field and the first index).
        """
        self._check_mirror_layout()
        for name, t in self.tensors().items():
            m = self.mirror(name)
            if m is None:
                continue
            differ = (t.cpu() != m).nonzero()
            if differ.numel():
                at = differ[0].tolist()
                raise MetadataError(
                    f"{name}_cpu disagrees with {name} at {at}: host {m[tuple(at)].item()}, "
                    f"device {t[tuple(at)].item()}; the host mirror must be a copy of this "
                    "step's device tensor")

    def _check_mirror_layout(self) -> None:
        """Host mirrors: CPU tensors of their field's dtype and shape (no device read)."""
        for name, t in self.tensors().items():
            m = self.mirror(name)
            if m is None:
                continue
            if not isinstance(m, torch.Tensor) or m.device.type != "cpu":
                where = m.device if isinstance(m, torch.Tensor) else type(m).__name__
                raise MetadataError(f"AttentionMetadata.{name}_cpu (host mirror of {name}) must "
                                    f"be a CPU tensor, got {where}")
            if m.dtype != FIELD_DTYPE[name] or m.shape != t.shape:
                raise MetadataError(
                    f"AttentionMetadata.{name}_cpu (host mirror of {name}) is {m.dtype} of shape "
                    f"{tuple(m.shape)}, but {name} is {t.dtype} of shape {tuple(t.shape)} "
                    f"(expected {FIELD_DTYPE[name]}): pass the mirror of this step's tensor")

    def validate(self, host: HostCounts | None = None) -> AttentionMetadata:
        """Check dtypes, shapes and the relations between the fields (and the host mirrors'
        device, dtype and shape: their values are trusted, see the module docstring).

        Args:
            host: ``(query_start_loc, seq_lens, num_computed_tokens)`` on the host when the
                caller has them (lists of ints or CPU tensors, e.g. :meth:`host_counts`); default
                :meth:`host_counts` (the mirrors, else one device read).

        Raises:
            MetadataError: naming the field and the values that disagree.
        """
        for name, dtype in FIELD_DTYPE.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise MetadataError(f"AttentionMetadata.{name} must be a tensor, got {type(t)}")
            if t.dtype != dtype:
                raise MetadataError(f"AttentionMetadata.{name} must be {dtype}, got {t.dtype}")
        r = self.num_reqs
        if self.query_start_loc.shape != (r + 1,):
            raise MetadataError(
                f"query_start_loc has shape {tuple(self.query_start_loc.shape)}, expected "
                f"[num_reqs + 1] = [{r + 1}] (num_reqs from seq_lens)"
            )
        for name in ("num_computed_tokens",):
            if getattr(self, name).shape != (r,):
                raise MetadataError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected [{r}]")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != r:
            raise MetadataError(
                f"block_table has shape {tuple(self.block_table.shape)}, expected [{r}, max_blocks]"
            )
        if self.slot_mapping.dim() != 1:
            raise MetadataError("slot_mapping must be 1-D [num_tokens]")
        self._check_mirror_layout()
        qsl, seq, ctx = (host_tensor(h) for h in (host if host is not None else self.host_counts()))
        if qsl.shape != (r + 1,) or seq.shape != (r,) or ctx.shape != (r,):
            raise MetadataError(
                f"host counts of {qsl.shape[0] - 1}, {seq.shape[0]} and {ctx.shape[0]} requests "
                f"(query_start_loc, seq_lens, num_computed_tokens) for metadata of {r}")
        _check_counts(qsl, seq, ctx, self.num_tokens, self.max_query_len, self.max_seq_len)
        return self


def _check_counts(qsl: torch.Tensor, seq: torch.Tensor, ctx: torch.Tensor, num_tokens: int,
                  max_query_len: int, max_seq_len: int) -> None:
    """The relations between the host counts (see the module docstring): a few vector ops on
    the host; the values are formatted only when a check fails."""
    last = int(qsl[-1]) if qsl.numel() else 0
    if seq.numel():
        qlens = qsl[1:] - qsl[:-1]
        if int(qsl[0]) != 0:
            raise MetadataError(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
        shortest, longest = (int(v) for v in qlens.aminmax())
        if shortest < 0:
            raise MetadataError(f"query_start_loc must be non-decreasing, got {qsl.tolist()}")
    if last > num_tokens:
        raise MetadataError(
            f"query_start_loc[-1]={last} exceeds num_tokens={num_tokens} (slot_mapping rows)")
    if not seq.numel():
        return
    if bool((seq < qlens).any()):
        raise MetadataError(
            f"seq_lens {seq.tolist()} shorter than the query lens {qlens.tolist()}"
        )
    if not torch.equal(ctx, (seq - qlens).to(ctx.dtype)):
        raise MetadataError(
            "num_computed_tokens must equal seq_lens - query_lens: got "
            f"{ctx.tolist()} vs {(seq - qlens).tolist()}"
        )
    if max_query_len < longest:
        raise MetadataError(f"max_query_len={max_query_len} < longest query {longest}")
    if max_seq_len < int(seq.max()):
        raise MetadataError(f"max_seq_len={max_seq_len} < longest sequence {int(seq.max())}")
