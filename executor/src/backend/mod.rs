//! Burn-facing kernels: the executor's autodiff operations and products, the mixed-
//! precision rules, the CPU kernels, attention's arithmetic and the ring attention, and the
//! port through which a pass reaches its peers ([`port`]).

pub mod amp;
pub mod attention;
pub mod cross_entropy;
pub mod dense;
pub mod dropout;
pub(crate) mod flex_conv;
pub(crate) mod flex_cross_entropy;
pub(crate) mod flex_exp;
pub(crate) mod flex_gated;
pub(crate) mod flex_gelu;
pub(crate) mod flex_gemm;
pub(crate) mod flex_heads;
pub(crate) mod flex_norm;
pub(crate) mod flex_pool;
pub(crate) mod flex_rotary;
pub(crate) mod flex_row_norm;
pub(crate) mod flex_softmax;
pub mod gated;
pub mod gelu;
pub mod heads;
pub mod kernels;
pub mod norm;
pub mod pool;
pub mod port;
pub mod resident;
pub mod ring;
pub mod rng;
pub mod rotary;
pub mod row_norm;

/// The CPU backend with autodiff.
pub type CpuBackend = burn::backend::Autodiff<burn::backend::Flex>;
