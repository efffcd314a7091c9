//! What a pooling layer asks of a backend's kernels (`crate::backend::kernels::Kernels::max_pool`).

/// A max pool's window: its size, stride and padding per axis (dilation 1, no ceiling
/// mode: the pools a spec can write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolWindow {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}
