//! The cluster as the compiler sees it: devices grouped into nodes, what one device can do
//! (`pipec_plan::device::DeviceModel`), and the cost of moving bytes between two devices or
//! running a collective over a group, as NCCL runs them: a ring inside a level, α per step
//! and the bytes at the link's bus bandwidth (`Link::efficiency` of its line rate); across
//! nodes, hierarchically — within each node, then across nodes on every device's own
//! network interface at once (a ring per rail), then within each node again.

use pipec_grammar::spec::{Cluster, Link};
use pipec_plan::device::DeviceModel;
use pipec_plan::{CollectiveKind, DeviceId};

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
    pub device: DeviceModel,
    pub intra: Link,
    pub inter: Link,
}

impl ClusterGraph {
    pub fn new(c: &Cluster) -> Self {
        ClusterGraph {
            nodes: c.nodes,
            devices_per_node: c.devices_per_node,
            memory: c.memory,
            device: c.device.clone(),
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

/// How a group of devices lies on the cluster ([`ClusterGraph::group_shape`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GroupShape {
    pub members: usize,
    /// Nodes the members span.
    pub nodes: usize,
    /// The most members on one node.
    pub per_node: usize,
}

impl ClusterGraph {
    /// Seconds of a collective of `kind` over `members`, `bytes` per member (an all-reduce's
    /// or a reduce-scatter's input, an all-gather's output): a ring when the group is inside
    /// one level; across nodes with several members per node, hierarchical — a reduce-scatter
    /// inside each node, the collective of each member's 1/k share across nodes on every
    /// member's own interface at once (k members per node), an all-gather inside each node.
    pub fn collective_time(&self, kind: CollectiveKind, members: &[DeviceId], bytes: u64) -> f64 {
        self.shaped_collective_time(kind, self.group_shape(members), bytes)
    }

    /// How a group of devices lies on the cluster (what a collective's time depends on):
    /// its members, the nodes they span, and the most members on one node.
    pub fn group_shape(&self, members: &[DeviceId]) -> GroupShape {
        let mut nodes: Vec<u32> = members.iter().map(|d| self.node_of(*d)).collect();
        nodes.sort_unstable();
        let (mut spanned, mut most, mut run) = (0usize, 0usize, 0usize);
        for (i, n) in nodes.iter().enumerate() {
            if i == 0 || nodes[i - 1] != *n {
                spanned += 1;
                run = 0;
            }
            run += 1;
            most = most.max(run);
        }
        GroupShape { members: members.len(), nodes: spanned, per_node: most.max(1) }
    }

    /// [`ClusterGraph::collective_time`] over a group of this shape.
    pub fn shaped_collective_time(&self, kind: CollectiveKind, shape: GroupShape, bytes: u64) -> f64 {
        let (p, q, k) = (shape.members, shape.nodes, shape.per_node);
        if p <= 1 {
            return 0.0;
        }
        let n = bytes as f64;
        if q == 1 {
            return ring_time(kind, self.intra, p, n);
        }
        if k == 1 {
            return match kind {
                CollectiveKind::AllReduce => across_nodes_allreduce_time(self.inter, p, n),
                _ => ring_time(kind, self.inter, p, n),
            };
        }
        let share = n / k as f64;
        match kind {
            CollectiveKind::AllReduce => {
                ring_time(CollectiveKind::ReduceScatter, self.intra, k, n)
                    + across_nodes_allreduce_time(self.inter, q, share)
                    + ring_time(CollectiveKind::AllGather, self.intra, k, n)
            }
            CollectiveKind::ReduceScatter => {
                ring_time(CollectiveKind::ReduceScatter, self.intra, k, n)
                    + ring_time(CollectiveKind::ReduceScatter, self.inter, q, share)
            }
            CollectiveKind::AllGather => {
                ring_time(CollectiveKind::AllGather, self.inter, q, share)
                    + ring_time(CollectiveKind::AllGather, self.intra, k, n)
            }
            // point to point, not hierarchical: each member's chunks for its node's other
            // members go over the node's links while those for the other nodes' members go
            // over its own interface, at once; the slower part sets the time
            CollectiveKind::AllToAll => {
                let chunk = n / p as f64;
                let part = |link: Link, peers: usize| {
                    peers as f64 * (link.latency + chunk / (link.bandwidth * link.efficiency))
                };
                part(self.intra, k - 1).max(part(self.inter, p - k))
            }
        }
    }
}

/// What DeepEP's dispatch is priced with: the experts each token chooses, and the
/// group-limited routing that bounds the groups they come from (`route_groups`,
/// `route_group_top`; 0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeepEpRouting {
    pub top_k: usize,
    pub groups: usize,
    pub group_top: usize,
}

impl DeepEpRouting {
    /// Routing over every expert: `top_k` choices, no groups.
    pub fn choices(top_k: usize) -> DeepEpRouting {
        DeepEpRouting { top_k, groups: 0, group_top: 0 }
    }

    /// The distinct nodes of `q` (holding the experts in order, an equal share each) a
    /// token's choices reach, routing uniform: q(1 − (1 − 1/q)^top_k) over every expert;
    /// with groups that nest in the nodes (G a multiple of q, G/q groups a node) at most
    /// the nodes holding the token's `group_top` groups, q(1 − C(G − G/q, g)/C(G, g)) for g
    /// groups drawn uniformly, each giving at least one expert (DeepSeek-V3's node-limited
    /// routing: 8 groups, 4 chosen, on 8 nodes: 4 nodes where unlimited choices reach 5.25).
    pub fn distinct_nodes(&self, q: usize) -> f64 {
        let qf = q as f64;
        let uniform = qf * (1.0 - (1.0 - 1.0 / qf).powf(self.top_k.max(1) as f64));
        let (g, chosen) = (self.groups, self.group_top);
        if g < q || !g.is_multiple_of(q.max(1)) || chosen == 0 || chosen > g {
            return uniform;
        }
        let per_node = g / q;
        // C(G − m, g) / C(G, g): no chosen group on a given node
        let missed: f64 = (0..chosen)
            .map(|i| if g < per_node + i + 1 { 0.0 } else { (g - per_node - i) as f64 / (g - i) as f64 })
            .product();
        uniform.min(qf * (1.0 - missed))
    }
}

/// How the spec's expert exchanges are priced where it dispatches them as DeepEP does
/// (`moe_dispatch: deepep`): what [`ClusterGraph::node_forwarded_time`] prices an expert
/// exchange with (the model's block with the most choices); None: plain all-to-alls.
pub(crate) fn deepep_routing(spec: &pipec_grammar::spec::Spec) -> Option<DeepEpRouting> {
    if spec.strategy.moe_dispatch != pipec_plan::vocab::MoeDispatch::DeepEp {
        return None;
    }
    spec.model.layers.iter().filter_map(|l| l.op.moe()).max_by_key(|m| m.top_k).map(|m| DeepEpRouting {
        top_k: m.top_k,
        groups: m.groups,
        group_top: m.group_top,
    })
}

impl ClusterGraph {
    /// Expert parallelism's dispatch (or combine) of `bytes` per member over `members` as
    /// DeepEP runs it (DeepSeek-AI 2024, DeepSeek-V3 technical report, arXiv 2412.19437,
    /// §3.2.2; the DeepEP library): a token crosses the network once per destination node
    /// its experts lie on, to the device of its own index there, which forwards it over
    /// NVLink to that node's chosen experts. Of the copies a plain all-to-all sends across
    /// nodes (top_k·(q−1)/q per token, routing uniform over q nodes), DeepEP sends the
    /// distinct nodes hit ([`DeepEpRouting::distinct_nodes`], fewer under node-limited
    /// routing) but its own; within a node the forwarded copies join the node's own. Every
    /// copy goes once to each device holding any of the token's experts, whatever their
    /// number there (DeepEP's dispatch layout, `is_token_in_rank`; the combine sums a
    /// device's experts' outputs before sending one row back): of the top_k/p routed pairs
    /// per token and device a plain all-to-all sends, 1 − (1 − 1/p)^top_k. The slower of
    /// the two parts sets the time. Across nodes each part pays its link's latency once:
    /// one kernel writes to every peer at once (DeepEP's normal kernels, each channel's
    /// warps sending to all ranks), where a ring pays it per step. A group inside one node
    /// is priced as an all-to-all of the copies (its latency per peer, as before).
    pub fn node_forwarded_time(&self, members: &[DeviceId], bytes: u64, routing: DeepEpRouting) -> f64 {
        let shape = self.group_shape(members);
        let (p, q, k) = (shape.members, shape.nodes, shape.per_node);
        let choices = routing.top_k.max(1) as f64;
        // the copies per device a token's choices reach, against the routed pairs
        let once_per_device = (routing.distinct_nodes(p) / choices).min(1.0);
        if q <= 1 || k <= 1 {
            let copies = (bytes as f64 * once_per_device) as u64;
            return self.shaped_collective_time(CollectiveKind::AllToAll, shape, copies);
        }
        let chunk = bytes as f64 / p as f64;
        let once_per_node = (routing.distinct_nodes(q) / choices).min(1.0);
        let remote = (p - k) as f64;
        let across =
            self.inter.latency + remote * chunk * once_per_node / (self.inter.bandwidth * self.inter.efficiency);
        let within = self.intra.latency
            + ((k - 1) as f64 * chunk + remote * chunk) * once_per_device
                / (self.intra.bandwidth * self.intra.efficiency);
        across.max(within)
    }
}

/// A ring collective of `bytes` per member over `p` members on `link`: an all-reduce is
/// 2(p−1) steps moving 2(p−1)/p of the bytes, a reduce-scatter or all-gather (p−1) steps
/// moving (p−1)/p of them; α per step, the bytes at the link's bus bandwidth. An all-to-all
/// is p−1 point-to-point sends of a 1/p chunk each, (p−1)/p of the bytes at the bus bandwidth
/// too (nccl-tests' PERFORMANCE.md defines alltoall's bus bandwidth as algbw · (p−1)/p).
pub fn ring_time(kind: CollectiveKind, link: Link, p: usize, bytes: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let steps = (p - 1) as f64;
    let share = steps / p as f64;
    let rate = link.bandwidth * link.efficiency;
    match kind {
        CollectiveKind::AllReduce => 2.0 * steps * link.latency + 2.0 * share * bytes / rate,
        CollectiveKind::ReduceScatter | CollectiveKind::AllGather | CollectiveKind::AllToAll => {
            steps * link.latency + share * bytes / rate
        }
    }
}

/// NCCL's tree all-reduce's bandwidth as a share of the ring's: `busBw * .92` for
/// `NCCL_ALGO_TREE` all-reduces in NCCL's tuning model (src/graph/tuning.cc).
pub const TREE_BANDWIDTH_SHARE: f64 = 0.92;

/// A (double binary) tree all-reduce of `bytes` over `p` members on `link`, as NCCL's tuning
/// model prices it: the data reduced up the tree and broadcast down, pipelined, so 2⌈log₂ p⌉
/// steps of latency, and the ring's bus bytes at [`TREE_BANDWIDTH_SHARE`] of its bandwidth.
pub fn tree_allreduce_time(link: Link, p: usize, bytes: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let depth = (p as f64).log2().ceil();
    let share = (p - 1) as f64 / p as f64;
    2.0 * depth * link.latency + 2.0 * share * bytes / (link.bandwidth * link.efficiency * TREE_BANDWIDTH_SHARE)
}

/// An all-reduce across nodes as NCCL runs it: the ring or the tree, whichever its tuning
/// model finds faster (the tree for latency-bound sizes over many nodes, the ring for large
/// ones).
pub fn across_nodes_allreduce_time(link: Link, p: usize, bytes: f64) -> f64 {
    ring_time(CollectiveKind::AllReduce, link, p, bytes).min(tree_allreduce_time(link, p, bytes))
}

/// Ring all-reduce of `bytes` over `p` members on `link`: 2(p−1)α + 2(p−1)/p · n · β (at the
/// link's bus bandwidth).
pub fn ring_allreduce_time(link: Link, p: usize, bytes: u64) -> f64 {
    ring_time(CollectiveKind::AllReduce, link, p, bytes as f64)
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

    fn cluster(nodes: usize, per_node: usize) -> ClusterGraph {
        ClusterGraph {
            nodes,
            devices_per_node: per_node,
            memory: 1e9,
            device: DeviceModel::uniform("x", 1e9, 1e12),
            intra: Link { bandwidth: 300e9, latency: 3e-6, efficiency: 0.75 },
            inter: Link { bandwidth: 25e9, latency: 6e-6, efficiency: 0.9 },
        }
    }

    #[test]
    fn an_all_reduce_across_nodes_takes_the_tree_where_latency_bounds_it_and_the_ring_elsewhere() {
        let c = cluster(64, 1);
        let ids: Vec<DeviceId> = (0..64).map(DeviceId).collect();
        let inter = c.inter;
        // 4 KiB over 64 nodes: the ring's 126 latencies against the tree's 2·6
        let small = c.collective_time(CollectiveKind::AllReduce, &ids, 4096);
        let tree = 12.0 * 6e-6 + 2.0 * 63.0 / 64.0 * 4096.0 / (22.5e9 * 0.92);
        assert!((small - tree).abs() < 1e-15, "{small} {tree}");
        assert!(small < ring_time(CollectiveKind::AllReduce, inter, 64, 4096.0) / 5.0);
        // 1 GB: bandwidth bound, where the ring's full bandwidth wins
        let large = c.collective_time(CollectiveKind::AllReduce, &ids, 1_000_000_000);
        assert_eq!(large, ring_time(CollectiveKind::AllReduce, inter, 64, 1e9));
        assert!(tree_allreduce_time(inter, 64, 1e9) > large);
        // the crossing is where 114 latencies (126 − 12) equal the tree's 8.7% of bandwidth
        let crossing = 114.0 * 6e-6 / (2.0 * 63.0 / 64.0 / 22.5e9 * (1.0 / 0.92 - 1.0));
        for bytes in [crossing * 0.9, crossing * 1.1] {
            let ring = ring_time(CollectiveKind::AllReduce, inter, 64, bytes);
            let t = tree_allreduce_time(inter, 64, bytes);
            assert_eq!(across_nodes_allreduce_time(inter, 64, bytes), ring.min(t));
            assert_eq!(t < ring, bytes < crossing, "{bytes}: tree {t}, ring {ring}");
        }
        // inside a node NCCL's ring (NVLink) stays; reduce-scatters and all-gathers are rings
        let node = cluster(1, 8);
        let eight: Vec<DeviceId> = (0..8).map(DeviceId).collect();
        assert_eq!(
            node.collective_time(CollectiveKind::AllReduce, &eight, 4096),
            ring_time(CollectiveKind::AllReduce, node.intra, 8, 4096.0)
        );
        assert_eq!(
            c.collective_time(CollectiveKind::ReduceScatter, &ids, 4096),
            ring_time(CollectiveKind::ReduceScatter, inter, 64, 4096.0)
        );
    }

    #[test]
    fn collectives_inside_a_node_are_rings_and_across_nodes_hierarchical() {
        let c = cluster(2, 8);
        let n = 1e9;
        let ids = |r: std::ops::Range<u32>| r.map(DeviceId).collect::<Vec<_>>();
        // 8 members in one node: the intra ring, at 0.75 of 300 GB/s
        let one = c.collective_time(CollectiveKind::AllReduce, &ids(0..8), n as u64);
        assert!((one - (14.0 * 3e-6 + 2.0 * 7.0 / 8.0 * n / 225e9)).abs() < 1e-12, "{one}");
        // one member per node: the inter ring
        let two = c.collective_time(CollectiveKind::AllReduce, &[DeviceId(0), DeviceId(8)], n as u64);
        assert!((two - (2.0 * 6e-6 + n / 22.5e9)).abs() < 1e-12, "{two}");
        // 16 members over 2 nodes: reduce-scatter in the node, all-reduce of an eighth on
        // each rail, all-gather in the node — far below a flat ring on the slower link
        let all = c.collective_time(CollectiveKind::AllReduce, &ids(0..16), n as u64);
        let rs = 7.0 * 3e-6 + 7.0 / 8.0 * n / 225e9;
        assert!((all - (2.0 * rs + 2.0 * 6e-6 + (n / 8.0) / 22.5e9)).abs() < 1e-12, "{all}");
        assert!(all < ring_allreduce_time(c.inter, 16, n as u64) / 4.0);
        // reduce-scatter then all-gather costs the all-reduce
        let rs = c.collective_time(CollectiveKind::ReduceScatter, &ids(0..16), n as u64);
        let ag = c.collective_time(CollectiveKind::AllGather, &ids(0..16), n as u64);
        assert!((rs + ag - all).abs() < 1e-9, "{rs} + {ag} vs {all}");
    }

    #[test]
    fn an_all_to_all_sends_a_chunk_to_every_other_member() {
        let c = cluster(2, 8);
        let n = 8.0e8;
        let ids = |r: std::ops::Range<u32>| r.map(DeviceId).collect::<Vec<_>>();
        // inside a node: 7 sends of an eighth at the bus bandwidth (300 GB/s × 0.75)
        let one = c.collective_time(CollectiveKind::AllToAll, &ids(0..8), n as u64);
        assert!((one - 7.0 * (3e-6 + n / 8.0 / 225e9)).abs() < 1e-12, "{one}");
        // 8 members on 2 nodes (4 each): 3 chunks over the node's links while 4 leave on the
        // member's own interface (25 GB/s × 0.9), which sets the time
        let members = [0, 1, 2, 3, 8, 9, 10, 11].map(DeviceId);
        let two = c.collective_time(CollectiveKind::AllToAll, &members, n as u64);
        assert!((two - 4.0 * (6e-6 + n / 8.0 / 22.5e9)).abs() < 1e-12, "{two}");
        // one member per node: a flat exchange on the interfaces
        let flat = c.collective_time(CollectiveKind::AllToAll, &[DeviceId(0), DeviceId(8)], n as u64);
        assert!((flat - (6e-6 + n / 2.0 / 22.5e9)).abs() < 1e-12, "{flat}");
    }

    #[test]
    fn deepep_sends_a_token_once_per_destination_node_and_device() {
        let c = cluster(2, 8);
        let n = 8.0e8;
        let members: Vec<DeviceId> = (0..16).map(DeviceId).collect();
        // 16 members on 2 nodes, 8 choices per token: a plain all-to-all sends 8 sixteenths
        // over the interface; DeepEP the token once to the other node, which 8 choices over
        // 2 nodes hit with probability 1 − 2^−8: of 4 remote copies per token, 0.996 sent
        let plain = c.collective_time(CollectiveKind::AllToAll, &members, n as u64);
        let once = 2.0 * (1.0 - 0.5f64.powi(8)) / 8.0;
        let chunk = n / 16.0;
        // one kernel sends to every peer at once: the link's latency once
        let across = 6e-6 + 8.0 * chunk * once / 22.5e9;
        // over NVLink, once to each device holding any of a token's experts: of 8/16 routed
        // pairs per device, 1 − (15/16)^8
        let per_device = 16.0 * (1.0 - (15.0f64 / 16.0).powi(8)) / 8.0;
        let within = 3e-6 + 15.0 * chunk * per_device / 225e9;
        let deepep = c.node_forwarded_time(&members, n as u64, DeepEpRouting::choices(8));
        assert!((deepep - across.max(within)).abs() < 1e-12, "{deepep}");
        assert!(deepep < plain / 3.5, "{deepep} against {plain}");
        // one choice per token: nothing to share, the links carry what they did
        let one = c.node_forwarded_time(&members, n as u64, DeepEpRouting::choices(1));
        let within_one = 3e-6 + 15.0 * chunk / 225e9;
        assert!((one - (6e-6 + 8.0 * chunk / 22.5e9).max(within_one)).abs() < 1e-12);
        // inside a node: an all-to-all of the copies, 8 choices over 8 devices reaching
        // 8(1 − (7/8)^8) = 5.25 of them
        let node: Vec<DeviceId> = (0..8).map(DeviceId).collect();
        let copies = n * 8.0 * (1.0 - (7.0f64 / 8.0).powi(8)) / 8.0;
        assert_eq!(
            c.node_forwarded_time(&node, n as u64, DeepEpRouting::choices(8)),
            c.collective_time(CollectiveKind::AllToAll, &node, copies as u64)
        );
        assert_eq!(
            c.node_forwarded_time(&node, n as u64, DeepEpRouting::choices(1)),
            c.collective_time(CollectiveKind::AllToAll, &node, n as u64)
        );
    }

    #[test]
    fn node_limited_routing_bounds_the_nodes_a_token_reaches() {
        // DeepSeek-V3: 8 of 256 experts per token; over 8 nodes unlimited choices reach
        // 8(1 − (7/8)^8) = 5.25 nodes, its 4 of 8 groups (one a node) 8(1 − C(7,4)/C(8,4)) = 4
        let v3 = DeepEpRouting { top_k: 8, groups: 8, group_top: 4 };
        let unlimited = 8.0 * (1.0 - (7.0f64 / 8.0).powi(8));
        assert!((DeepEpRouting::choices(8).distinct_nodes(8) - unlimited).abs() < 1e-12);
        assert!((v3.distinct_nodes(8) - 4.0).abs() < 1e-12, "{}", v3.distinct_nodes(8));
        // two groups a node on 4 nodes: 4(1 − C(6,4)/C(8,4)) = 4(1 − 15/70)
        assert!((v3.distinct_nodes(4) - 4.0 * (1.0 - 15.0 / 70.0)).abs() < 1e-12);
        // groups that do not nest in the nodes bound nothing
        assert_eq!(v3.distinct_nodes(16), DeepEpRouting::choices(8).distinct_nodes(16));
        // priced: 64 members on 8 nodes, the interface's part in proportion
        let c = cluster(8, 8);
        let members: Vec<DeviceId> = (0..64).map(DeviceId).collect();
        let (n, chunk) = (8.0e8, 8.0e8 / 64.0);
        let across = |nodes: f64| 6e-6 + 56.0 * chunk * nodes / 8.0 / 22.5e9;
        let within = |r: DeepEpRouting| 3e-6 + 63.0 * chunk * r.distinct_nodes(64) / 8.0 / 225e9;
        for (routing, nodes) in [(DeepEpRouting::choices(8), unlimited), (v3, 4.0)] {
            let t = c.node_forwarded_time(&members, n as u64, routing);
            assert!((t - across(nodes).max(within(routing))).abs() < 1e-12, "{routing:?}: {t}");
        }
    }

    #[test]
    fn ring_allreduce_closed_form() {
        let l = Link::new(1e9, 1e-5);
        // 4 members, 1 GB: 6α + 1.5 s
        let t = ring_allreduce_time(l, 4, 1_000_000_000);
        assert!((t - (6.0 * 1e-5 + 1.5)).abs() < 1e-12);
        assert_eq!(ring_allreduce_time(l, 1, 10), 0.0);
    }
}
