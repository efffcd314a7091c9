//! The cluster as the compiler sees it: devices grouped into nodes, and the α-β cost of
//! moving bytes between two devices or reducing them over a group.

use pipec_grammar::spec::{Cluster, Link};
use pipec_plan::DeviceId;

/// The link level between two devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    SameDevice,
    IntraNode,
    InterNode,
}

/// Devices and links.
#[derive(Debug, Clone)]
pub struct ClusterGraph {
    pub nodes: usize,
    pub devices_per_node: usize,
    pub memory: f64,
    pub throughput: f64,
    pub intra: Link,
    pub inter: Link,
}

impl ClusterGraph {
    pub fn new(c: &Cluster) -> Self {
        ClusterGraph {
            nodes: c.nodes,
            devices_per_node: c.devices_per_node,
            memory: c.memory,
            throughput: c.throughput,
            intra: c.intra_node,
            inter: c.inter_node.unwrap_or(c.intra_node),
        }
    }
    pub fn device_count(&self) -> usize {
        self.nodes * self.devices_per_node
    }
    /// Every device, in id order.
    pub fn devices(&self) -> Vec<DeviceId> {
        (0..self.device_count()).map(|d| DeviceId(d as u32)).collect()
    }
    pub fn node_of(&self, d: DeviceId) -> u32 {
        d.0 / self.devices_per_node.max(1) as u32
    }
    pub fn level(&self, a: DeviceId, b: DeviceId) -> Level {
        if a == b {
            Level::SameDevice
        } else if self.node_of(a) == self.node_of(b) {
            Level::IntraNode
        } else {
            Level::InterNode
        }
    }
    pub fn link(&self, level: Level) -> Option<Link> {
        match level {
            Level::SameDevice => None,
            Level::IntraNode => Some(self.intra),
            Level::InterNode => Some(self.inter),
        }
    }
    /// α + n·β for a point-to-point transfer.
    pub fn p2p_time(&self, a: DeviceId, b: DeviceId, bytes: u64) -> f64 {
        match self.link(self.level(a, b)) {
            None => 0.0,
            Some(l) => l.latency + bytes as f64 / l.bandwidth,
        }
    }
    /// The slowest level inside a group of devices.
    pub fn group_level(&self, devices: &[DeviceId]) -> Level {
        let mut level = Level::SameDevice;
        for w in devices.windows(2) {
            level = level.max(self.level(w[0], w[1]));
        }
        if let (Some(first), Some(last)) = (devices.first(), devices.last()) {
            level = level.max(self.level(*first, *last));
        }
        level
    }
}

/// Ring all-reduce of `bytes` over `p` members on `link`: 2(p−1)α + 2(p−1)/p · n · β.
pub fn ring_allreduce_time(link: Link, p: usize, bytes: u64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let p = p as f64;
    2.0 * (p - 1.0) * link.latency + 2.0 * (p - 1.0) / p * bytes as f64 / link.bandwidth
}

/// A central parameter server: every worker pushes its gradient and pulls the result, and
/// the server's link carries all of it: 2(p−1)·(α + n·β) with the server one of the members.
pub fn parameter_server_time(link: Link, p: usize, bytes: u64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    2.0 * (p as f64 - 1.0) * (link.latency + bytes as f64 / link.bandwidth)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_allreduce_closed_form() {
        let l = Link { bandwidth: 1e9, latency: 1e-5 };
        // 4 members, 1 GB: 6α + 1.5 s
        let t = ring_allreduce_time(l, 4, 1_000_000_000);
        assert!((t - (6.0 * 1e-5 + 1.5)).abs() < 1e-12);
        assert_eq!(ring_allreduce_time(l, 1, 10), 0.0);
    }
}
