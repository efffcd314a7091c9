//! The instruction interpreter: a device's `Worker` running its stream, the stage states it
//! owns, the values passed between instructions, and the collectives, buckets, clipping and
//! checkpoint copies it performs.

pub(crate) mod worker;
pub(crate) mod compute;
pub(crate) mod collectives;
pub(crate) mod clip;
pub(crate) mod buckets;
pub(crate) mod stage;
pub(crate) mod values;
pub(crate) mod checkpointing;
