"""Bases for low-rank gradient sketches, and moment transport between bases.

For a weight ``W ∈ R^{m×n}`` with gradient ``G``, LoGRA keeps an orthonormal right basis
``Q ∈ R^{n×r}`` and sketches the gradient as ``S = G Q ∈ R^{m×r}``. ``Q`` comes from a
randomized range finder (default; Halko, Martinsson & Tropp 2011: ``Y = Gᵀ Ω``, power
iterations, Rayleigh–Ritz), a full SVD (GaLore, Zhao et al. 2024), a random basis (Flora,
Hao et al. 2024) or ``Q = I`` (exactly AdamW). A new basis is aligned to the old one
(orthogonal Procrustes) and the moments are transported with ``R = Q_oldᵀ Q_new``:
``M ← M R``, ``V ← V (R ∘ R)`` (LDAdam, Robert et al. 2024, without error feedback).
``PROJECTIONS`` maps each name to a ``Projection``. Row reductions go through an
optional ``all_reduce`` (sum), so row-sharded gradients give every rank the same ``Q``.

Derivations, costs and message sizes: docs/optimizer.md#bases and
docs/optimizer.md#alignment-and-moment-transport.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loggra_megatron.optim.registry import sketches_shape

AllReduce = Callable[[torch.Tensor], None]


def gaussian_test_matrix(
    rows: int, cols: int, seed: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The seeded Gaussian ``Ω ∈ R^{rows×cols}``; identical for equal (seed, device type)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype)


def _orth(y: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(y, mode="reduced").Q


def range_finder_basis(
    grad_rows: torch.Tensor,
    rank: int,
    oversample: int,
    power_iters: int,
    omega_rows: torch.Tensor,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """Randomized range finder for the top-``rank`` right singular subspace of G.

    Args:
        grad_rows: ``[m_local, n]`` rows of G held by this rank (all rows when local).
        rank: r, number of basis vectors returned.
        oversample: p; ``k = min(r + p, n)`` probe vectors are used.
        power_iters: q, power (subspace) iterations.
        omega_rows: ``[m_local, k]`` rows of Ω matching ``grad_rows``.
        all_reduce: in-place sum over the ranks that hold the other rows of G.

    Returns:
        ``Q`` ``[n, rank]`` with orthonormal columns, identical on all ranks.
    """
    g = grad_rows.float()
    y = g.t() @ omega_rows  # [n, k]
    if all_reduce is not None:
        all_reduce(y)
    for _ in range(power_iters):
        y = g.t() @ (g @ _orth(y))  # [n, k]
        if all_reduce is not None:
            all_reduce(y)
    q_y = _orth(y)  # [n, k]
    b = (g @ q_y).double()  # [m_local, k]
    c = b.t() @ b  # [k, k], Σ over rows
    if all_reduce is not None:
        all_reduce(c)
    _, eigvecs = torch.linalg.eigh(c)  # ascending eigenvalues
    top = eigvecs.flip(-1)[:, :rank].to(q_y.dtype)
    return q_y @ top


def svd_basis(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """GaLore-style basis: top-``rank`` right singular vectors of the full G ``[m, n]``."""
    _, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    return vh[:rank].t().contiguous()


def gram_svd_basis(
    grad_rows: torch.Tensor, rank: int, all_reduce: AllReduce | None = None
) -> torch.Tensor:
    """GaLore's basis for row-sharded G: top-``rank`` eigenvectors of ``GᵀG`` ``[n, n]``.

    ``grad_rows`` are this rank's rows of G; ``all_reduce`` sums the Gram matrix over the
    ranks holding the other rows. Equals ``svd_basis`` up to the sign of each column.
    """
    g = grad_rows.double()
    gram = g.t() @ g  # [n, n]
    if all_reduce is not None:
        all_reduce(gram)
    _, eigvecs = torch.linalg.eigh(gram)  # ascending eigenvalues
    return eigvecs.flip(-1)[:, :rank].float().contiguous()


def random_basis(n: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    """Flora-style basis: orthonormalised seeded Gaussian ``[n, rank]``."""
    return _orth(gaussian_test_matrix(n, rank, seed, device, torch.float32))


def align_basis(q_raw: torch.Tensor, q_old: torch.Tensor) -> torch.Tensor:
    """Rotate ``q_raw`` within its span to be closest to ``q_old`` (orthogonal Procrustes)."""
    u, _, vh = torch.linalg.svd(q_raw.t() @ q_old)
    return q_raw @ (u @ vh)


def transport_moments(
    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, q_old: torch.Tensor, q_new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sketch-space moments ``[m, r]`` moved from basis ``q_old`` to ``q_new`` (new tensors)."""
    r = q_old.t() @ q_new  # [r, r]
    return exp_avg @ r, exp_avg_sq @ (r * r)


# ---------------------------------------------------------------------- projection objects
OmegaRows = Callable[[int], torch.Tensor]
"""``k ->`` this rank's rows of the seeded Gaussian test matrix ``Ω`` with ``k`` columns."""


class Projection:
    """How the basis of a sketched weight is chosen (subclasses override what differs)."""

    refreshes = True
    """False: the basis never changes (``identity``)."""
    uses_gradient = True
    """False: the basis is drawn from the seed alone, with no collective (``random``)."""

    def sketches(self, shape: tuple[int, ...], min_dim: int) -> bool:
        """Whether a 2-D weight of ``shape`` gets the low-rank update."""
        return sketches_shape(shape, min_dim)

    def rank(self, shape: tuple[int, int], requested: int) -> int:
        """The sketch rank of an ``[m, n]`` weight (``requested`` clamped to ``min(m, n)``)."""
        return min(requested, *shape)

    def clamps(self, shape: tuple[int, int], requested: int) -> bool:
        """Whether ``rank`` lowers ``requested`` for this shape (worth a warning)."""
        return self.rank(shape, requested) < requested

    def initial_basis(self, n: int, rank: int, **factory) -> torch.Tensor:
        """The basis before the first refresh (``factory``: device and dtype)."""
        return torch.zeros(n, rank, **factory)

    def local_basis(self, grad: torch.Tensor, rank: int, seed: int, settings: dict):
        """``Q_raw [n, rank]`` from a whole ``[m, n]`` gradient."""
        raise NotImplementedError

    def sharded_basis(
        self,
        rows,
        n: int,
        rank: int,
        seed: int,
        settings: dict,
        omega_rows: OmegaRows,
        all_reduce: AllReduce | None,
        device,
    ):
        """``Q_raw [n, rank]`` from this rank's gradient ``rows``, identical on every rank
        that joins ``all_reduce`` (collective unless ``uses_gradient`` is False)."""
        raise NotImplementedError


class RangeFinder(Projection):
    """The randomized range finder (default)."""

    def local_basis(self, grad, rank, seed, settings):
        m, n = grad.shape
        omega = gaussian_test_matrix(
            m, self._k(rank, n, settings), seed, grad.device, torch.float32
        )
        return range_finder_basis(
            grad, rank, settings["oversample"], settings["power_iters"], omega
        )

    def sharded_basis(self, rows, n, rank, seed, settings, omega_rows, all_reduce, device):
        omega = omega_rows(self._k(rank, n, settings))
        return range_finder_basis(
            rows, rank, settings["oversample"], settings["power_iters"], omega, all_reduce
        )

    @staticmethod
    def _k(rank: int, n: int, settings: dict) -> int:
        return min(rank + settings["oversample"], n)


class GaLoreSVD(Projection):
    """GaLore's exact top-r subspace (a baseline for measurement)."""

    def local_basis(self, grad, rank, seed, settings):
        return svd_basis(grad, rank)

    def sharded_basis(self, rows, n, rank, seed, settings, omega_rows, all_reduce, device):
        return gram_svd_basis(rows, rank, all_reduce)


class RandomSubspace(Projection):
    """Flora's seeded random subspace, independent of the gradient."""

    uses_gradient = False

    def local_basis(self, grad, rank, seed, settings):
        return random_basis(grad.shape[1], rank, seed, grad.device)

    def sharded_basis(self, rows, n, rank, seed, settings, omega_rows, all_reduce, device):
        return random_basis(n, rank, seed, device)


class Identity(Projection):
    """``Q = I`` (r = n) for every 2-D weight: LoGRA-AdamW is exactly AdamW."""

    refreshes = False

    def sketches(self, shape, min_dim):
        return len(shape) == 2

    def rank(self, shape, requested):
        return shape[1]

    def clamps(self, shape, requested):
        return False

    def initial_basis(self, n, rank, **factory):
        return torch.eye(n, **factory)


PROJECTIONS: dict[str, Projection] = {
    "range_finder": RangeFinder(),
    "svd": GaLoreSVD(),
    "random": RandomSubspace(),
    "identity": Identity(),
}
"""``--loggra-projection`` name → projection (one line per projection)."""
