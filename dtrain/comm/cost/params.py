"""The parameters of the alpha-beta-gamma cost model: one link's costs (:class:`LinkCost`) and a machine's
(:class:`CostParams`, inside and across nodes). :mod:`dtrain.comm.cost.model` says what each term prices."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

__all__ = ["LinkCost", "CostParams"]


#: LinkCost fields that may be None (see its docstring for what None means).
_OPTIONAL = ("alpha_peer_s", "beta_peer_s_per_byte", "beta_many_s_per_byte")


@dataclass(frozen=True, kw_only=True)
class LinkCost:
    """Cost of one kind of link in the multi-port model with per-link and injection bandwidth limits.

    ``alpha_s``: a round's start-up; ``alpha_peer_s``: the start-up each further peer adds to a round whose
    messages are posted together (``None``: equal to ``alpha_s``, the single-port model).
    ``beta_s_per_byte``: seconds per byte a rank sends or receives, all peers together (injection bandwidth);
    ``beta_peer_s_per_byte``: seconds per byte between one pair of ranks in one direction (link bandwidth;
    ``None``: no per-pair limit beyond ``beta_s_per_byte``). ``gamma_s_per_byte``: seconds to reduce a
    received byte into the buffer. ``beta_many_s_per_byte``: seconds per byte of a rank that talks to
    several peers in one round, where that is slower than one peer (peer-memory reads from every peer at
    once contend; ``None``: no such penalty).
    """

    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    alpha_peer_s: float | None = None
    beta_peer_s_per_byte: float | None = None
    beta_many_s_per_byte: float | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is None and name in _OPTIONAL:
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"LinkCost.{name} must be a finite number >= 0, got {value!r}")

    @property
    def per_peer_s(self) -> float:
        """The start-up of each further peer in a round: ``alpha_peer_s``, or ``alpha_s`` when that is None."""
        return self.alpha_s if self.alpha_peer_s is None else self.alpha_peer_s

    def round_start_s(self, peers: int) -> float:
        """Start-up of a round in which the busiest rank talks to ``peers`` peers (none: free)."""
        return self.alpha_s + (peers - 1) * self.per_peer_s if peers > 0 else 0.0

    @property
    def pair_s_per_byte(self) -> float:
        """Seconds per byte between one pair of ranks: ``beta_peer_s_per_byte``, or ``beta_s_per_byte`` when
        that is None (the rank's limit, which already bounds any one pair)."""
        return self.beta_s_per_byte if self.beta_peer_s_per_byte is None else self.beta_peer_s_per_byte

    @property
    def one_peer_s_per_byte(self) -> float:
        """Seconds per byte when each rank talks to one peer: the slower of the rank's and the pair's."""
        return max(self.beta_s_per_byte, self.pair_s_per_byte)

    def wire_s(self, rank_nbytes: float, pair_nbytes: float) -> float:
        """Wire time of a round whose busiest rank moves ``rank_nbytes`` (all peers, one direction) and whose
        busiest pair ``pair_nbytes`` (one direction): ``max(beta * rank_nbytes, beta_peer * pair_nbytes)``,
        and at least ``beta_many * rank_nbytes`` when the rank talks to several peers."""
        wire = max(self.beta_s_per_byte * rank_nbytes, self.pair_s_per_byte * pair_nbytes)
        if self.beta_many_s_per_byte is not None and rank_nbytes > pair_nbytes:
            wire = max(wire, self.beta_many_s_per_byte * rank_nbytes)
        return wire


@dataclass(frozen=True, kw_only=True)
class CostParams:
    """Link costs inside a node (``intra``) and across nodes (``inter``; ``None`` means the same as intra)."""

    intra: LinkCost
    inter: LinkCost | None = None

    @property
    def inter_link(self) -> LinkCost:
        return self.intra if self.inter is None else self.inter

    def to_dict(self) -> dict:
        return {"intra": asdict(self.intra), "inter": None if self.inter is None else asdict(self.inter)}

    @classmethod
    def from_dict(cls, data: Mapping) -> CostParams:
        """Inverse of :meth:`to_dict`; unknown or missing fields raise ``ValueError``, except ``alpha_peer_s``
        and ``beta_peer_s_per_byte``, which files written before them lack (read as None: the single-port
        model, no per-pair bandwidth limit)."""
        try:
            intra = LinkCost(**data["intra"])
            inter = None if data.get("inter") is None else LinkCost(**data["inter"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a CostParams dict ({exc}): {dict(data)!r}") from None
        return cls(intra=intra, inter=inter)
