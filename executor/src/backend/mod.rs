//! Burn-facing kernels: the executor's autodiff operations and products, the mixed-
//! precision rules, the CPU kernels, the ring attention, and the port through which a pass
//! reaches its peers (`port::PassPort`).

pub mod amp;
pub(crate) mod flex_gemm;
pub(crate) mod flex_softmax;
pub(crate) mod flex_weights;
pub mod dense;
pub mod rng;
pub mod resident;
pub mod ring;
