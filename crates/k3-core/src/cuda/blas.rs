//! Dense GEMM through cuBLASLt (default) or cuBLAS: bf16/f16 inputs with f32 accumulation
//! (bf16/f16 or f32 output), and true f32 (`CUBLAS_COMPUTE_32F`, no TF32).
//!
//! Row-major contract, the same as `kernels::cpu::matmul::linear`:
//! - [`linear`]: `out[M,N] = x[M,K] · w[N,K]ᵀ` (`w` stored like a checkpoint's Linear weight);
//! - [`matmul`]: `out[M,N] = a[M,K] · b[K,N]` (what `torch.matmul` does).
//!
//! cuBLAS is column-major, so a row-major `out = a · op(b)` is computed as the column-major
//! `outᵀ = op(b)ᵀ · aᵀ`: cuBLAS's A is our `b`, its B is our `a`, m = N, n = M.
//!
//! cuBLASLt plans (descriptors, layouts, chosen algorithm) are cached per shape. The
//! algorithm is picked by cuBLASLt's heuristic with a 32 MiB workspace; for problems of at
//! least [`TUNE_MIN_MACS`] multiply-adds, [`Algo::Auto`] also times the heuristic's top
//! candidates once on the real buffers and keeps the fastest.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublas::{result as bres, sys as bsys};
use cudarc::cublaslt::{result as lres, sys as lsys};
use cudarc::driver::result as dres;

use super::{derr, library_report, lock, require, CudaDevice, CudaTensor};
use crate::{CoreError, DType, Result};

/// cuBLASLt workspace per device (NVIDIA's recommendation for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;
/// [`Algo::Auto`] times candidates for problems of at least this many multiply-adds.
pub const TUNE_MIN_MACS: u64 = 1 << 30;
/// Heuristic candidates considered when tuning.
const TUNE_CANDIDATES: usize = 8;
/// Timed calls per candidate when tuning.
const TUNE_CALLS: usize = 5;

/// Operand layout of `b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// `b` is `[N, K]`: `out = a · bᵀ` (Linear weight; cuBLAS "TN").
    BT,
    /// `b` is `[K, N]`: `out = a · b` (cuBLAS "NN").
    B,
}

/// Which library runs the GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Backend {
    #[default]
    Lt,
    Cublas,
}

/// How cuBLASLt's algorithm is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algo {
    /// Tuned for large problems (≥ [`TUNE_MIN_MACS`]), heuristic otherwise.
    #[default]
    Auto,
    /// cuBLASLt's first heuristic choice.
    Heuristic,
    /// Time the top heuristic candidates once per shape and keep the fastest.
    Tuned,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GemmOptions {
    pub backend: Backend,
    pub algo: Algo,
}

/// `out[M,N] = x[M,K] · w[N,K]ᵀ` with default options (`x` may have leading batch dims).
pub fn linear(x: &CudaTensor, w: &CudaTensor, out: &CudaTensor) -> Result<()> {
    gemm(x, w, out, Layout::BT, GemmOptions::default())
}

/// `out[M,N] = a[M,K] · b[K,N]` with default options.
pub fn matmul(a: &CudaTensor, b: &CudaTensor, out: &CudaTensor) -> Result<()> {
    gemm(a, b, out, Layout::B, GemmOptions::default())
}

/// One operand of [`gemm_strided_batched`]: a row-major matrix view at raw device address
/// `ptr` with leading dimension `ld` (elements between rows) and `stride` (elements between
/// consecutive batch entries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub ptr: u64,
    pub ld: usize,
    pub stride: usize,
}

/// Per batch entry `b`: `C_b[M,N] = A_b[M,K] · op(B_b)` (`op(B) = Bᵀ` for [`Layout::BT`], `B[N,K]`;
/// `B` for [`Layout::B`], `B[K,N]`), row-major views with explicit leading dims and batch
/// strides (in elements), f32 accumulation, via cuBLAS `cublasGemmStridedBatchedEx`. Inputs
/// BF16 (or F16 / F32), output BF16/F16 like the input or F32. Raw addresses let a caller
/// address per-head slices inside bigger tensors (e.g. the `q_nope` part of `q [N, nh, dn+dr]`
/// with `ld = nh·(dn+dr)`, `stride = dn+dr`); the caller guarantees every view lies inside
/// live allocations of `dev` (only `ld`/dims are checked here). Capturable (cuBLAS uses the
/// preallocated workspace).
pub fn gemm_strided_batched(
    dev: &CudaDevice,
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    a: Strided,
    b: Strided,
    layout: Layout,
    c: Strided,
    input: DType,
    output: DType,
) -> Result<()> {
    const OP: &str = "cuda gemm_strided_batched";
    let ok_types = matches!((input, output), (DType::BF16, DType::BF16 | DType::F32) | (DType::F16, DType::F16 | DType::F32) | (DType::F32, DType::F32));
    if !ok_types {
        return Err(CoreError::DType { op: OP, dtype: format!("{input} -> {output}") });
    }
    let b_cols = if layout == Layout::BT { k } else { n };
    if a.ld < k || b.ld < b_cols || c.ld < n {
        return Err(CoreError::Shape {
            op: OP,
            detail: format!("leading dims too small: a.ld {} (>= K={k}), b.ld {} (>= {b_cols}), c.ld {} (>= N={n})", a.ld, b.ld, c.ld),
        });
    }
    if [m, n, k, batch, a.ld, b.ld, c.ld].iter().any(|&v| v > i32::MAX as usize) || [a.stride, b.stride, c.stride].iter().any(|&v| v > i64::MAX as usize) {
        return Err(CoreError::Shape { op: OP, detail: format!("M={m} N={n} K={k} batch={batch} or a leading dim exceeds i32") });
    }
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    if k == 0 {
        return Err(CoreError::Shape { op: OP, detail: "K = 0 (an empty product) is not supported: zero C instead".into() });
    }
    dev.bind()?;
    let mut guard = lock(&dev.inner().blas);
    if guard.is_none() {
        *guard = Some(Blas::new()?);
    }
    let blas = guard.as_mut().ok_or_else(|| CoreError::Device("cuBLAS state missing".into()))?;
    blas.strided_batched(dev, Problem { m, n, k, layout, input, output }, batch, a, b, c, 0.0)
}

/// One problem of [`gemm_grouped`] at raw device addresses: row-major `C[m, N] = A[m, K] · B[N, K]ᵀ`,
/// each operand contiguous (leading dims K, K and N).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedProblem {
    pub m: usize,
    pub a: u64,
    pub b: u64,
    pub c: u64,
}

/// Several GEMMs of the same `N`, `K` and different row counts in one cuBLAS call
/// (`cublasGemmGroupedBatchedEx`, one group per problem): `C_i = A_i · B_iᵀ`, f32
/// accumulation, `output` the same type as `input` (BF16, F16 or F32; cuBLAS 13.1 refuses a
/// BF16 → F32 grouped GEMM with NOT_SUPPORTED, seen on the H200). One launch fills the GPU with
/// all problems' tiles instead of each small GEMM's last partial wave (the MoE prefill's
/// experts). The pointer arrays are uploaded per call (stream-ordered); the caller guarantees
/// every view lies inside live allocations of `dev`. Problems with `m = 0` are skipped.
pub fn gemm_grouped(dev: &CudaDevice, n: usize, k: usize, problems: &[GroupedProblem], input: DType, output: DType) -> Result<()> {
    const OP: &str = "cuda gemm_grouped";
    if !matches!((input, output), (DType::BF16, DType::BF16) | (DType::F16, DType::F16) | (DType::F32, DType::F32)) {
        return Err(CoreError::DType { op: OP, dtype: format!("{input} -> {output}") });
    }
    let live: Vec<&GroupedProblem> = problems.iter().filter(|p| p.m > 0).collect();
    if live.is_empty() || n == 0 {
        return Ok(());
    }
    if k == 0 || [n, k].iter().chain(live.iter().map(|p| &p.m)).any(|&v| v > i32::MAX as usize) {
        return Err(CoreError::Shape { op: OP, detail: format!("N={n} K={k}: need 0 < K and every dim within i32") });
    }
    let g = live.len();
    // cuBLAS's A is our B (op T, [K, N] column-major, ld K), its B our A (ld K), C ld N.
    let mut ptrs: Vec<u64> = Vec::with_capacity(3 * g);
    ptrs.extend(live.iter().map(|p| p.b));
    ptrs.extend(live.iter().map(|p| p.a));
    ptrs.extend(live.iter().map(|p| p.c));
    let ptrs_d = CudaTensor::from_pod(dev, DType::I64, vec![3 * g], &ptrs)?;
    let base = ptrs_d.ptr();
    let ta = vec![bsys::cublasOperation_t::CUBLAS_OP_T; g];
    let tb = vec![bsys::cublasOperation_t::CUBLAS_OP_N; g];
    let ms = vec![n as i32; g];
    let ns: Vec<i32> = live.iter().map(|p| p.m as i32).collect();
    let ks = vec![k as i32; g];
    let (lda, ldc) = (vec![k as i32; g], vec![n as i32; g]);
    let (alpha, beta) = (vec![1.0f32; g], vec![0.0f32; g]);
    let sizes = vec![1i32; g];
    dev.bind()?;
    let mut guard = lock(&dev.inner().blas);
    if guard.is_none() {
        *guard = Some(Blas::new()?);
    }
    let blas = guard.as_mut().ok_or_else(|| CoreError::Device("cuBLAS state missing".into()))?;
    let h = blas.cublas_handle()?;
    // SAFETY: live handle; the host arrays hold g entries each and live through the call (cuBLAS
    // reads them before returning); the device pointer array is stream-ordered before the GEMM.
    unsafe {
        bres::set_stream(h, dev.cu_stream() as bsys::cudaStream_t).map_err(derr("cublasSetStream"))?;
        bsys::cublasGemmGroupedBatchedEx(
            h,
            ta.as_ptr(),
            tb.as_ptr(),
            ms.as_ptr(),
            ns.as_ptr(),
            ks.as_ptr(),
            alpha.as_ptr() as *const c_void,
            base as *const *const c_void,
            data_type_b(input),
            lda.as_ptr(),
            (base + 8 * g as u64) as *const *const c_void,
            data_type_b(input),
            lda.as_ptr(),
            beta.as_ptr() as *const c_void,
            (base + 16 * g as u64) as *const *mut c_void,
            data_type_b(output),
            ldc.as_ptr(),
            g as i32,
            sizes.as_ptr(),
            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
        .result()
        .map_err(derr("cublasGemmGroupedBatchedEx"))?;
    }
    drop(ptrs_d);
    Ok(())
}

/// The problem after validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Problem {
    m: usize,
    n: usize,
    k: usize,
    layout: Layout,
    input: DType,
    output: DType,
}

fn data_type(d: DType) -> lsys::cudaDataType_t {
    match d {
        DType::BF16 => lsys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => lsys::cudaDataType_t::CUDA_R_16F,
        _ => lsys::cudaDataType_t::CUDA_R_32F,
    }
}

fn data_type_b(d: DType) -> bsys::cudaDataType_t {
    match d {
        DType::BF16 => bsys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => bsys::cudaDataType_t::CUDA_R_16F,
        _ => bsys::cudaDataType_t::CUDA_R_32F,
    }
}

/// `out = a · op(b)`; see the module docs for shapes and dtypes.
pub fn gemm(a: &CudaTensor, b: &CudaTensor, out: &CudaTensor, layout: Layout, opts: GemmOptions) -> Result<()> {
    let Some(p) = problem("cuda gemm", a, b, out, layout)? else { return Ok(()) };
    if p.k == 0 {
        return out.fill_bytes(0);
    }
    gemm_raw(a.cuda_device(), p, a.ptr(), b.ptr(), out.ptr(), opts)
}

/// `out += a · op(b)`: [`gemm`]'s shapes and dtypes with cuBLAS's β = 1, so the product is added
/// to what `out` holds in the GEMM's own epilogue (f32 accumulation, one rounding to `out`'s
/// dtype) — no stored product and separate add (the vision tower's residual adds). Always the
/// cuBLAS backend: cuBLASLt's tuning runs the GEMM several times on the real buffers.
pub fn gemm_add(a: &CudaTensor, b: &CudaTensor, out: &CudaTensor, layout: Layout) -> Result<()> {
    let Some(p) = problem("cuda gemm_add", a, b, out, layout)? else { return Ok(()) };
    if p.k == 0 {
        return Ok(());
    }
    let dev = a.cuda_device();
    dev.bind()?;
    let mut guard = lock(&dev.inner().blas);
    if guard.is_none() {
        *guard = Some(Blas::new()?);
    }
    let blas = guard.as_mut().ok_or_else(|| CoreError::Device("cuBLAS state missing".into()))?;
    blas.cublas_gemm(dev, p, a.ptr(), b.ptr(), out.ptr(), 1.0)
}

/// The checked problem of `out = a · op(b)`; `None` when `out` is empty.
fn problem(op: &'static str, a: &CudaTensor, b: &CudaTensor, out: &CudaTensor, layout: Layout) -> Result<Option<Problem>> {
    let dev = a.cuda_device();
    if !b.cuda_device().same(dev) || !out.cuda_device().same(dev) {
        return Err(CoreError::Shape { op, detail: "operands on different devices".into() });
    }
    let ok_types = matches!(
        (a.dtype(), b.dtype(), out.dtype()),
        (DType::BF16, DType::BF16, DType::BF16 | DType::F32) | (DType::F16, DType::F16, DType::F16 | DType::F32) | (DType::F32, DType::F32, DType::F32)
    );
    if !ok_types {
        return Err(CoreError::DType { op, dtype: format!("{} · {} -> {}", a.dtype(), b.dtype(), out.dtype()) });
    }
    if b.shape().len() != 2 {
        return Err(CoreError::Shape { op, detail: format!("b must be 2-D, got {b:?}") });
    }
    let k = a.last_dim();
    let m = a.numel().checked_div(k).unwrap_or(0);
    let (bk, n) = match layout {
        Layout::BT => (b.shape()[1], b.shape()[0]),
        Layout::B => (b.shape()[0], b.shape()[1]),
    };
    if bk != k || out.numel() != m * n || out.last_dim() != n {
        return Err(CoreError::Shape {
            op,
            detail: format!("a {a:?}, b {b:?} ({layout:?}), out {out:?}: need a [M,K], b {}, out [M,N]", if layout == Layout::BT { "[N,K]" } else { "[K,N]" }),
        });
    }
    if [m, n, k].iter().any(|&v| v > i32::MAX as usize) {
        return Err(CoreError::Shape { op, detail: format!("M={m} N={n} K={k} exceed i32") });
    }
    if m == 0 || n == 0 {
        return Ok(None);
    }
    Ok(Some(Problem { m, n, k, layout, input: a.dtype(), output: out.dtype() }))
}

fn gemm_raw(dev: &CudaDevice, p: Problem, a: u64, b: u64, c: u64, opts: GemmOptions) -> Result<()> {
    dev.bind()?;
    let mut guard = lock(&dev.inner().blas);
    if guard.is_none() {
        *guard = Some(Blas::new()?);
    }
    let blas = guard.as_mut().ok_or_else(|| CoreError::Device("cuBLAS state missing".into()))?;
    match opts.backend {
        Backend::Lt => blas.lt_gemm(dev, p, a, b, c, opts.algo),
        Backend::Cublas => blas.cublas_gemm(dev, p, a, b, c, 0.0),
    }
}

/// Per-device BLAS state: handles, workspace, cached plans.
pub(crate) struct Blas {
    lt: lsys::cublasLtHandle_t,
    cublas: Option<bsys::cublasHandle_t>,
    workspace: u64,
    plans: HashMap<(Problem, Algo), Plan>,
}

// SAFETY: the handles are used only under the device's `blas` mutex.
unsafe impl Send for Blas {}

impl Blas {
    fn new() -> Result<Self> {
        require(library_report().cublaslt, "libcublasLt.so (cuBLASLt)")?;
        let lt = lres::create_handle().map_err(derr("cublasLtCreate"))?;
        // SAFETY: plain allocation; the caller bound the context.
        let workspace = match unsafe { dres::malloc_sync(WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: lt was just created.
                let _ = unsafe { lres::destroy_handle(lt) };
                return Err(derr("allocating the cuBLASLt workspace")(e));
            }
        };
        Ok(Blas { lt, cublas: None, workspace, plans: HashMap::new() })
    }

    fn lt_gemm(&mut self, dev: &CudaDevice, p: Problem, a: u64, b: u64, c: u64, algo: Algo) -> Result<()> {
        let macs = (p.m * p.n * p.k) as u64;
        let tune = algo == Algo::Tuned || (algo == Algo::Auto && macs >= TUNE_MIN_MACS);
        let key = (p, if tune { Algo::Tuned } else { Algo::Heuristic });
        if !self.plans.contains_key(&key) {
            let mut plan = Plan::new(p)?;
            let cands = plan.heuristics(self.lt, if tune { TUNE_CANDIDATES } else { 1 })?;
            plan.algo = cands[0];
            if tune && cands.len() > 1 {
                let mut best = (f32::INFINITY, cands[0]);
                for cand in cands {
                    plan.algo = cand;
                    if let Ok(ms) = self.time_plan(dev, &plan, a, b, c) {
                        if ms < best.0 {
                            best = (ms, cand);
                        }
                    }
                }
                plan.algo = best.1;
            }
            self.plans.insert(key, plan);
        }
        let plan = self.plans.get(&key).ok_or_else(|| CoreError::Device("cuBLASLt plan missing".into()))?;
        self.run_plan(dev, plan, a, b, c)
    }

    fn run_plan(&self, dev: &CudaDevice, plan: &Plan, a: u64, b: u64, c: u64) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: descriptors are live; pointers are device buffers of the validated sizes; the
        // workspace is WORKSPACE_BYTES long.
        unsafe {
            lres::matmul(
                self.lt,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                plan.la,
                a as *const c_void,
                plan.lb,
                c as *const c_void,
                plan.lc,
                c as *mut c_void,
                plan.lc,
                &plan.algo,
                self.workspace as *mut c_void,
                WORKSPACE_BYTES,
                dev.cu_stream() as lsys::cudaStream_t,
            )
        }
        .map_err(derr("cublasLtMatmul"))
    }

    /// Fastest single call with `plan.algo`, in ms: 1 warm-up, then [`TUNE_CALLS`] calls
    /// back to back with an event between each; the minimum is robust to clock dips.
    fn time_plan(&self, dev: &CudaDevice, plan: &Plan, a: u64, b: u64, c: u64) -> Result<f32> {
        self.run_plan(dev, plan, a, b, c)?;
        let events = (0..=TUNE_CALLS).map(|_| dev.new_event(true)).collect::<Result<Vec<_>>>()?;
        let stream = dev.stream();
        events[0].record(&stream)?;
        for e in &events[1..] {
            self.run_plan(dev, plan, a, b, c)?;
            e.record(&stream)?;
        }
        let mut best = f32::INFINITY;
        for w in events.windows(2) {
            best = best.min(w[0].elapsed_ms(&w[1])?);
        }
        Ok(best)
    }

    /// The cuBLAS handle, created on first use. It is given the cuBLASLt workspace (both run
    /// on the one compute stream, so they never use it at the same time), which keeps cuBLAS
    /// from allocating during CUDA-graph capture.
    fn cublas_handle(&mut self) -> Result<bsys::cublasHandle_t> {
        if let Some(h) = self.cublas {
            return Ok(h);
        }
        require(library_report().cublas, "libcublas.so (cuBLAS)")?;
        let h = bres::create_handle().map_err(derr("cublasCreate"))?;
        self.cublas = Some(h);
        // SAFETY: live handle; the workspace holds WORKSPACE_BYTES and outlives the handle.
        unsafe { bsys::cublasSetWorkspace_v2(h, self.workspace as *mut c_void, WORKSPACE_BYTES) }.result().map_err(derr("cublasSetWorkspace"))?;
        Ok(h)
    }

    /// One plain GEMM `c = a · op(b) + beta · c` through cuBLAS: the batch-1 case of
    /// [`Blas::strided_batched`] with contiguous row-major operands.
    fn cublas_gemm(&mut self, dev: &CudaDevice, p: Problem, a: u64, b: u64, c: u64, beta: f32) -> Result<()> {
        let b_ld = if p.layout == Layout::BT { p.k } else { p.n };
        let view = |ptr: u64, ld: usize| Strided { ptr, ld, stride: 0 };
        self.strided_batched(dev, p, 1, view(a, p.k), view(b, b_ld), view(c, p.n), beta)
    }

    fn strided_batched(&mut self, dev: &CudaDevice, p: Problem, batch: usize, a: Strided, b: Strided, c: Strided, beta: f32) -> Result<()> {
        let h = self.cublas_handle()?;
        let alpha = 1.0f32;
        let ta = match p.layout {
            Layout::BT => bsys::cublasOperation_t::CUBLAS_OP_T,
            Layout::B => bsys::cublasOperation_t::CUBLAS_OP_N,
        };
        // Row-major C = A · op(B) is column-major Cᵀ = op(B)ᵀ · Aᵀ: cuBLAS's A is our b, m = N, n = M.
        // SAFETY: live handle; the caller validated that every view lies in its buffers' extents.
        unsafe {
            bres::set_stream(h, dev.cu_stream() as bsys::cudaStream_t).map_err(derr("cublasSetStream"))?;
            bres::gemm_strided_batched_ex(
                h,
                ta,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                p.n as i32,
                p.m as i32,
                p.k as i32,
                &alpha as *const f32 as *const c_void,
                b.ptr as *const c_void,
                data_type_b(p.input),
                b.ld as i32,
                b.stride as i64,
                a.ptr as *const c_void,
                data_type_b(p.input),
                a.ld as i32,
                a.stride as i64,
                &beta as *const f32 as *const c_void,
                c.ptr as *mut c_void,
                data_type_b(p.output),
                c.ld as i32,
                c.stride as i64,
                batch as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(derr("cublasGemmStridedBatchedEx"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: handles and workspace were created by this struct; the owner bound the
        // context and synchronised the stream before dropping it.
        unsafe {
            if let Some(h) = self.cublas.take() {
                let _ = bres::destroy_handle(h);
            }
            let _ = lres::destroy_handle(self.lt);
            let _ = dres::free_sync(self.workspace);
        }
    }
}

/// A cuBLASLt matmul descriptor, its three layouts and the chosen algorithm.
struct Plan {
    desc: lsys::cublasLtMatmulDesc_t,
    la: lsys::cublasLtMatrixLayout_t,
    lb: lsys::cublasLtMatrixLayout_t,
    lc: lsys::cublasLtMatrixLayout_t,
    algo: lsys::cublasLtMatmulAlgo_t,
}

impl Plan {
    fn new(p: Problem) -> Result<Self> {
        let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
        // cuBLASLt's A is our b: [N,K] row-major = K×N column-major (transposed by the op),
        // or [K,N] row-major = N×K column-major.
        let (ar, ac, ld_a, op_a) = match p.layout {
            Layout::BT => (k, n, k, 1i32),
            Layout::B => (n, k, n, 0i32),
        };
        let mut plan = Plan {
            desc: std::ptr::null_mut(),
            la: std::ptr::null_mut(),
            lb: std::ptr::null_mut(),
            lc: std::ptr::null_mut(),
            algo: lsys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        plan.desc = lres::create_matmul_desc(lsys::cublasComputeType_t::CUBLAS_COMPUTE_32F, lsys::cudaDataType_t::CUDA_R_32F)
            .map_err(derr("cublasLtMatmulDescCreate"))?;
        let op_b = 0i32;
        // SAFETY: desc is live; the attribute values are i32 cublasOperation_t.
        unsafe {
            lres::set_matmul_desc_attribute(
                plan.desc,
                lsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_a as *const i32 as *const c_void,
                4,
            )
            .map_err(derr("setting TRANSA"))?;
            lres::set_matmul_desc_attribute(
                plan.desc,
                lsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                &op_b as *const i32 as *const c_void,
                4,
            )
            .map_err(derr("setting TRANSB"))?;
        }
        plan.la = lres::create_matrix_layout(data_type(p.input), ar, ac, ld_a as i64).map_err(derr("layout A"))?;
        plan.lb = lres::create_matrix_layout(data_type(p.input), k, m, k as i64).map_err(derr("layout B"))?;
        plan.lc = lres::create_matrix_layout(data_type(p.output), n, m, n as i64).map_err(derr("layout C"))?;
        Ok(plan)
    }

    /// Up to `want` algorithms from cuBLASLt's heuristic, best first (at least one, or an error).
    fn heuristics(&self, lt: lsys::cublasLtHandle_t, want: usize) -> Result<Vec<lsys::cublasLtMatmulAlgo_t>> {
        let pref = lres::create_matmul_pref().map_err(derr("cublasLtMatmulPreferenceCreate"))?;
        let ws = WORKSPACE_BYTES;
        // SAFETY: MaybeUninit-free: the results array is zeroed plain-old-data.
        let mut results: Vec<lsys::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; want];
        let mut count = 0i32;
        // SAFETY: live handles and descriptors; `results` holds `want` entries.
        let status = unsafe {
            let s = lres::set_matmul_pref_attribute(
                pref,
                lsys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                std::mem::size_of::<usize>(),
            );
            let h = s.and_then(|_| {
                lsys::cublasLtMatmulAlgoGetHeuristic(lt, self.desc, self.la, self.lb, self.lc, self.lc, pref, want as i32, results.as_mut_ptr(), &mut count)
                    .result()
            });
            let _ = lres::destroy_matmul_pref(pref);
            h
        };
        status.map_err(derr("cublasLtMatmulAlgoGetHeuristic"))?;
        let algos: Vec<_> =
            results.iter().take(count.max(0) as usize).filter(|r| r.state == lsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).map(|r| r.algo).collect();
        if algos.is_empty() {
            return Err(CoreError::Device("cuBLASLt found no algorithm for this GEMM".into()));
        }
        Ok(algos)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by Plan::new (null ones are skipped).
        unsafe {
            for l in [self.la, self.lb, self.lc] {
                if !l.is_null() {
                    let _ = lres::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lres::destroy_matmul_desc(self.desc);
            }
        }
    }
}
