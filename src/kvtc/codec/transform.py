"""The PCA transform of the codec: feature rows -> coefficients (:meth:`PCATransform.project`) and back
(:meth:`PCATransform.reconstruct`), in the codec's precision, with each basis cached on the codec's device.

Precisions (on CUDA with the fused kernels; the CPU path always computes in fp32):

* ``fp32``: the reference arithmetic (TF32 off);
* ``bf16``: tensor cores, fp32 accumulate (the projection returns float32, the reconstruction bfloat16);
* ``fp8``: E4M3 operands, fp32 accumulate (``torch._scaled_mm``; about twice bf16's rate on Hopper; adds about
  1e-3 relative squared error to the projection). The coefficients are padded with zero columns to a multiple
  of :data:`FP8_ALIGN` components.

fp8 scales are folded into the bases, so neither direction needs a pass over its operand to find per-row scales:
the projection feeds ``(x − µ) / d`` (``d``: each feature's spread under the calibration's PCA, from its
eigenvalues and basis) to a basis multiplied by ``d``; the reconstruction feeds ``c / σ`` (``σ``: each component's
standard deviation, the square root of its eigenvalue) to a basis multiplied by ``σ``. Both operands then sit
well inside E4M3's range (±448, with 3 mantissa bits wherever a value is above 2^-6) and are written in one pass
(:func:`kvtc.kernels.rows_to_fp8`; the unpack+dequantize kernel writes ``c / σ`` as fp8 directly); the basis
keeps a per-feature (reconstruction) or per-component (projection) scale, and the product runs with row-wise
scales of one, the mean added in its epilogue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..calibration.artifact import Calibration
from ..coding.buffers import align
from ..quant import FP8_MAX

#: projection arithmetic on CUDA (see the module docstring)
PRECISIONS = ("fp32", "bf16", "fp8")
#: fp8 bases are padded to a multiple of this many components (cuBLASLt's fast fp8 kernels want K % 32 == 0)
FP8_ALIGN = 64
#: fp8 products accumulate with Hopper's fast (reduced-precision) accumulation: far below the error of fp8 operands
FP8_FAST_ACCUM = True

Basis = tuple[torch.Tensor, torch.Tensor]


class PCATransform:
    """Projection and reconstruction with a calibration's PCA bases, in one precision on one device.

    ``fused``: the codec runs the fused GPU path (only then do ``bf16`` and ``fp8`` apply)."""

    def __init__(self, calibration: Calibration, device: torch.device, precision: str, fused: bool):
        self.calibration = calibration
        self.device = device
        self.bf16 = fused and precision == "bf16"
        self.fp8 = fused and precision == "fp8"
        self._bases: dict[tuple, Basis] = {}

    # ------------------------------------------------------------------ bases
    def _side(self, kind: str, g: int, decode: bool) -> bool:
        """Whether the decode basis differs from the encode one (sensitivity-weighted groups only): the cache
        keys on this, so an unweighted codec holds one copy of each basis for both directions."""
        return decode and self.calibration.pcas[kind][g].scale is not None

    def basis(self, kind: str, g: int, k: int, decode: bool = False) -> Basis:
        """``(mean, first k basis rows)`` on the device (the rows in bfloat16 for ``bf16``)."""
        decode = self._side(kind, g, decode)
        mean, basis = self.basis_fp32(kind, g, decode)
        if self.bf16:
            bkey = (kind, g, "bf16", decode)
            if bkey not in self._bases:
                self._bases[bkey] = (mean, basis.to(torch.bfloat16))
            basis = self._bases[bkey][1]
        return mean, basis[:k]

    def fp8_basis(self, kind: str, g: int, k: int, transposed: bool) -> Basis:
        """The first ``k`` basis rows, their scales folded in (see the module docstring), in E4M3 with their
        scales, padded with zero rows to a multiple of :data:`FP8_ALIGN` components (fp8 matmuls need 16; on the
        H200 a count that is 16 mod 32 runs ~30% slower, docs/studies/fp8-alignment.md). ``transposed=False``
        (projection): rows times each feature's spread ``d``, ``[p, k16]`` column-major with per-component
        scales ``[1, k16]``; ``True`` (reconstruction): rows times each component's ``σ``, ``[k16, p]``
        column-major with per-feature scales ``[1, p]``."""
        key = (kind, g, "fp8", k, transposed)
        if key not in self._bases:
            _, basis = self.basis_fp32(kind, g, decode=transposed)
            k16 = align(k, FP8_ALIGN)
            b = torch.zeros((k16, basis.shape[1]), dtype=torch.float32, device=self.device)
            if transposed:
                b[:k] = basis[:k] * self.sigma(kind, g)[:k, None]
            else:
                b[:k] = basis[:k] * self.feature_spread(kind, g)[None, :]
            if not transposed:
                scale = (b.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-30)
                q = (b / scale[:, None]).to(torch.float8_e4m3fn)  # [k16, p] row-major = [p, k16] column-major
                self._bases[key] = (q.T, scale[None, :].contiguous())
            else:
                scale = (b.abs().amax(dim=0) / FP8_MAX).clamp(min=1e-30)
                q = (b / scale[None, :]).T.contiguous().to(torch.float8_e4m3fn)  # [p, k16] row-major
                self._bases[key] = (q.T, scale[None, :].contiguous())
        return self._bases[key]

    def sigma(self, kind: str, g: int) -> torch.Tensor:
        """float32 ``[rank]``: each component's standard deviation (√eigenvalue; a tiny floor, never zero)."""
        key = (kind, g, "sigma")
        if key not in self._bases:
            ev = self.calibration.pcas[kind][g].eigenvalues.to(self.device, torch.float32)
            ev = torch.nan_to_num(ev, nan=0.0, posinf=0.0).clamp(min=0)
            floor = float(ev.max()) * 1e-12 if ev.numel() else 0.0
            self._bases[key] = (ev.clamp(min=max(floor, 1e-30)).sqrt(), ev)
        return self._bases[key][0]

    def feature_spread(self, kind: str, g: int) -> torch.Tensor:
        """float32 ``[p]``: each feature's standard deviation under the PCA (``√Σ_j λ_j u_jf²`` over the decode
        basis ``u`` in feature units, plus the variance past the basis spread evenly), floored at 1e-6 of the
        largest."""
        key = (kind, g, "spread")
        if key not in self._bases:
            pca = self.calibration.pcas[kind][g]
            _, u = self.basis_fp32(kind, g, decode=True)
            self.sigma(kind, g)
            ev = self._bases[(kind, g, "sigma")][1]
            var = (ev[:, None] * u.square()).sum(0)
            rest = max(float(pca.total_variance) - float(ev.sum()), 0.0) / max(u.shape[1], 1)
            if pca.scale is not None:
                rest = rest / pca.scale.to(self.device).square()
            d = (var + rest).sqrt()
            d = d.clamp(min=max(float(d.max()) * 1e-6, 1e-30)) if d.numel() else d
            self._bases[key] = (d, 1.0 / d)
        return self._bases[key][0]

    def basis_fp32(self, kind: str, g: int, decode: bool = False) -> Basis:
        """``(mean, basis)`` in feature units: the projection's (encode) or the reconstruction's (decode); they
        differ only for a sensitivity-weighted calibration (:meth:`PCAResult.coder_basis`). float32 on the device:
        the calibration's float16 basis is moved as such and widened there."""
        decode = self._side(kind, g, decode)
        key = (kind, g, decode)
        if key not in self._bases:
            pca = self.calibration.pcas[kind][g]
            mean, basis = pca.coder_basis(decode, self.device)
            self._bases[key] = (mean, basis.contiguous())
        return self._bases[key]

    # ------------------------------------------------------------------ the two directions
    def coefficient_columns(self, k: int) -> int:
        """Columns of the coefficients of ``k`` components (fp8: padded to :data:`FP8_ALIGN`)."""
        return align(k, FP8_ALIGN) if self.fp8 else k

    @property
    def coefficient_dtype(self) -> torch.dtype:
        """The dtype of the coefficients :meth:`reconstruct` takes from the fused decoder."""
        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype :meth:`reconstruct` produces."""
        return torch.bfloat16 if self.fp8 or self.bf16 else torch.float32

    def fp8_column_scale(self, kind: str, g: int, k: int) -> torch.Tensor:
        """float32 ``[k16]``: ``1/σ`` of the first ``k`` components, zero past them: the factors that turn the
        coefficients into the fp8 operand of :meth:`reconstruct` (the unpack+dequantize kernel applies them)."""
        key = (kind, g, "inv_sigma", k)
        if key not in self._bases:
            out = torch.zeros(align(k, FP8_ALIGN), dtype=torch.float32, device=self.device)
            out[:k] = 1.0 / self.sigma(kind, g)[:k]
            self._bases[key] = (out, out)
        return self._bases[key][0]

    def project(self, kind: str, g: int, x: torch.Tensor, k: int) -> torch.Tensor:
        """``(x − µ) @ basisᵀ`` of group ``g``'s first ``k`` components, ``[rows, k]`` (float32; bfloat16 for
        ``fp8``, a view with a padded row stride). ``x``: ``[rows, p]``, or for ``fp8`` also ``[B, T, p]`` with
        any batch and token strides (the rows are read in place)."""
        mean, basis = self.basis(kind, g, k)
        if self.fp8:
            from .. import kernels

            fp8 = self.fp8_basis(kind, g, k, False)
            self.feature_spread(kind, g)
            inv = self._bases[(kind, g, "spread")][1]
            a = kernels.rows_to_fp8(x, mean, inv)
            out = torch._scaled_mm(
                a, fp8[0], scale_a=self._ones(a.shape[0]), scale_b=fp8[1], out_dtype=torch.bfloat16,
                use_fast_accum=FP8_FAST_ACCUM,
            )  # fmt: skip
            return out[:, : basis.shape[0]]
        x = x.reshape(-1, x.shape[-1])
        if self.bf16:
            return _mm_f32((x.to(torch.bfloat16) - mean.to(torch.bfloat16)), basis.T)
        with _no_tf32():
            return (x.float() - mean) @ basis.T

    def reconstruct(
        self, kind: str, g: int, coeffs: torch.Tensor, k: int, out: list[torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """``coeffs @ basis + µ`` of group ``g``'s first ``k`` components, in :attr:`out_dtype`. ``out``:
        ``[rows, features]`` tensors of :attr:`out_dtype` that take consecutive blocks of the rows (then None is
        returned). For ``fp8``, ``coeffs`` may be the E4M3 operand itself (already times
        :meth:`fp8_column_scale`)."""
        mean, basis = self.basis(kind, g, k, decode=True)
        if self.fp8:
            return self._reconstruct_fp8(kind, g, k, coeffs, mean, self.fp8_basis(kind, g, k, True), out)
        return self._addmm(coeffs, mean, basis, out)

    def reconstruct_columns(
        self, kind: str, g: int, coeffs: torch.Tensor, k: int, columns: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`reconstruct` of the feature ``columns`` of group ``g`` alone (one layer's, say)."""
        return self.product(coeffs, *self.basis_columns(kind, g, k, columns))

    def basis_columns(self, kind: str, g: int, k: int, columns: torch.Tensor) -> Basis:
        """``(mean, basis)`` of the feature ``columns`` of group ``g``'s first ``k`` components (the reconstruction's):
        what :meth:`reconstruct_columns` multiplies by, gathered once for a caller that multiplies many row blocks."""
        mean, basis = self.basis(kind, g, k, decode=True)
        return mean[columns], basis[:, columns]

    def product(
        self, coeffs: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``coeffs @ basis + mean`` as :meth:`reconstruct_columns` computes it (:meth:`basis_columns`' operands),
        into ``out`` when given."""
        if out is None:
            return self._addmm(coeffs, mean, basis, None)  # type: ignore[return-value]
        self._addmm(coeffs, mean, basis, [out])
        return out

    def _addmm(
        self, coeffs: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, out: list[torch.Tensor] | None
    ) -> torch.Tensor | None:
        if self.bf16:
            mean, coeffs = mean.to(torch.bfloat16), coeffs.to(torch.bfloat16)
        if out is None:
            with _no_tf32():
                return torch.addmm(mean, coeffs, basis)
        r0 = 0
        with _no_tf32():
            for o in out:
                torch.addmm(mean, coeffs[r0 : r0 + o.shape[0]], basis, out=o)
                r0 += o.shape[0]
        return None

    def _ones(self, n: int) -> torch.Tensor:
        """float32 ``[n, 1]`` ones (row-wise scales of one; every slice from row 0 is 16-byte aligned)."""
        key = ("ones",)
        got = self._bases.get(key)
        if got is None or got[0].shape[0] < n:
            t = torch.ones((align(max(n, 1), 1 << 16), 1), dtype=torch.float32, device=self.device)
            self._bases[key] = got = (t, t)
        return got[0][:n]

    def _reconstruct_fp8(
        self,
        kind: str,
        g: int,
        k: int,
        coeffs: torch.Tensor,
        mean: torch.Tensor,
        fp8: Basis,
        out: list[torch.Tensor] | None,
    ) -> torch.Tensor | None:
        k16 = fp8[0].shape[0]
        if coeffs.dtype == torch.float8_e4m3fn:
            a, sa = coeffs, self._ones(coeffs.shape[0])
        else:  # float coefficients: scale them here, with per-row scales
            c = coeffs.float() * self.fp8_column_scale(kind, g, k)[: coeffs.shape[1]]
            c = c if c.shape[1] == k16 else torch.nn.functional.pad(c, (0, k16 - c.shape[1]))
            a, sa = _fp8_rows(c)
        mean16 = mean.to(torch.bfloat16)
        if out is None:
            return _scaled_mm_into(a, sa, fp8, mean16, None)
        r0 = 0
        for o in out:
            r1 = r0 + o.shape[0]
            # cuBLASLt wants 16-byte aligned scale pointers: a block starting at a row that is not a multiple of
            # 4 gets its own copy of the (tiny) row-scale vector; its fp8 rows are k16 bytes each, always aligned
            sa_blk = sa[r0:r1] if r0 % 4 == 0 else sa[r0:r1].clone()
            _scaled_mm_into(a[r0:r1], sa_blk, fp8, mean16, o)
            r0 = r1
        return None


#: whether torch._scaled_mm here takes a bias and an ``out`` with row-wise scales (found out on first use)
_FUSED_EPILOGUE: list[bool] = []


def _scaled_mm_into(
    a: torch.Tensor, sa: torch.Tensor, fp8: Basis, mean16: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """``a·sa @ fp8 + mean16`` in bfloat16, into ``out`` when given: the mean added in the product's epilogue
    where torch offers it, else by one more pass."""
    kw = dict(scale_a=sa, scale_b=fp8[1], out_dtype=torch.bfloat16, use_fast_accum=FP8_FAST_ACCUM)
    if _FUSED_EPILOGUE != [False]:
        try:
            if out is None:
                res = torch._scaled_mm(a, fp8[0], bias=mean16, **kw)
            else:
                res = torch._scaled_mm(a, fp8[0], bias=mean16, out=out, **kw)
            if not _FUSED_EPILOGUE:
                _FUSED_EPILOGUE.append(True)
            return res
        except (RuntimeError, TypeError):
            if _FUSED_EPILOGUE:
                raise
            _FUSED_EPILOGUE.append(False)
    res = torch._scaled_mm(a, fp8[0], **kw)
    if out is None:
        return res.add_(mean16)
    return torch.add(res, mean16, out=out)


@contextmanager
def _no_tf32() -> Iterator[None]:
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, m]`` -> (E4M3 values, float32 per-row scales ``[n, 1]``) for ``torch._scaled_mm`` (the
    division runs in ``x``'s own dtype: no float32 copy of a bf16 input)."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-30).to(x.dtype)
    q = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 product with float32 output (fp32 accumulate) where torch offers it, else upcast."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return torch.mm(a, b).float()


__all__ = ["FP8_ALIGN", "PRECISIONS", "PCATransform"]
