//! The layers as Burn modules (a stage's model), built from the plan's operators; their
//! parameters as host values. A layer reaches a peer only through the backend's port.

pub mod block;
pub mod context;
#[cfg(test)]
mod hf_reference;
pub mod latent;
pub mod layers;
pub(crate) mod params;
pub mod parts;
pub(crate) mod routed;
pub mod routing;
