//! The layers as Burn modules (a stage's model), built from the plan's operators; their
//! parameters as host values. A layer reaches a peer only through the backend's port.

pub mod layers;
pub mod context;
pub(crate) mod params;
#[cfg(test)]
mod hf_reference;
