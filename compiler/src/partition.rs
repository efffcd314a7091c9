//! Partitioning: which contiguous layers each stage holds, and (for `auto`) how many workers
//! replicate each stage.
//!
//! - [`min_max_contiguous`]: the exact dynamic program behind `balanced`: split `n` layers
//!   into `k` contiguous non-empty stages minimising the slowest stage, for any stage cost
//!   that does not grow when a stage starts later. O(k·n·log n).
//! - [`auto`]: PipeDream's planner: the number of stages and the replication of each stage
//!   that minimise the time per microbatch on `machines` workers, counting compute, the
//!   weight all-reduce of replicated stages (amortised over a step's microbatches) and the
//!   activation/gradient transfer at each cut on the link level the cut falls on, and
//!   rejecting stages whose memory does not fit. It searches the bottleneck time by bisection
//!   and, for each candidate, finds the fewest machines that reach it with an O(n²) dynamic
//!   program, so 1,000 layers × 1,024 workers plan in milliseconds.

use std::ops::Range;

/// Splits `n` items into `k` contiguous non-empty ranges minimising the maximum of
/// `cost(stage, start, end)`. `cost` must not increase as `start` grows (for fixed stage
/// and end). When, in addition, the stages are interchangeable (`uniform`: the optimum of
/// the first p items only grows with p), each cell is found by binary search, O(k·n·log n);
/// otherwise every split point is tried, O(k·n²). Returns the ranges and the optimal
/// maximum, or None when `k > n` or `k == 0`.
pub fn min_max_contiguous(
    n: usize,
    k: usize,
    uniform: bool,
    cost: impl Fn(usize, usize, usize) -> f64,
) -> Option<(Vec<Range<usize>>, f64)> {
    if k == 0 || k > n {
        return None;
    }
    // best[j][i]: optimum for the first i items in j+1 stages; choice[j][i]: start of stage j.
    let mut best = vec![vec![f64::INFINITY; n + 1]; k];
    let mut choice = vec![vec![0usize; n + 1]; k];
    for (i, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = cost(0, 0, i);
    }
    for j in 1..k {
        for i in (j + 1)..=n {
            if !uniform {
                for p in j..i {
                    let v = best[j - 1][p].max(cost(j, p, i));
                    if v < best[j][i] {
                        best[j][i] = v;
                        choice[j][i] = p;
                    }
                }
                continue;
            }
            // candidates p in [j, i-1]: max(best[j-1][p], cost(j, p, i)); the first term
            // grows with p, the second shrinks: the optimum sits at their crossing.
            let (mut lo, mut hi) = (j, i - 1);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if best[j - 1][mid] >= cost(j, mid, i) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            let mut best_v = f64::INFINITY;
            let mut best_p = lo;
            for p in [lo.saturating_sub(1).max(j), lo] {
                let v = best[j - 1][p].max(cost(j, p, i));
                if v < best_v {
                    best_v = v;
                    best_p = p;
                }
            }
            best[j][i] = best_v;
            choice[j][i] = best_p;
        }
    }
    let mut ranges = vec![0..0; k];
    let mut end = n;
    for j in (0..k).rev() {
        let start = if j == 0 { 0 } else { choice[j][end] };
        ranges[j] = start..end;
        end = start;
    }
    Some((ranges, best[k - 1][n]))
}

/// The stage time of `balanced`: compute per microbatch divided by the stage's replicas.
pub fn balanced(layer_times: &[f64], replicas: &[usize]) -> Option<(Vec<Range<usize>>, f64)> {
    let prefix = prefix_sums(layer_times);
    let uniform = replicas.windows(2).all(|w| w[0] == w[1]);
    min_max_contiguous(layer_times.len(), replicas.len(), uniform, |j, p, i| {
        (prefix[i] - prefix[p]) / replicas[j].max(1) as f64
    })
}

/// Prefix sums over the layers of their time, parameter bytes and memory, so any range's
/// total is one subtraction.
struct Prefixes {
    time: Vec<f64>,
    weights: Vec<f64>,
    memory: Vec<f64>,
}

/// Prefix sums: `out[i]` = sum of the first i values.
pub fn prefix_sums(values: &[f64]) -> Vec<f64> {
    let mut out = Vec::with_capacity(values.len() + 1);
    out.push(0.0);
    let mut acc = 0.0;
    for v in values {
        acc += v;
        out.push(acc);
    }
    out
}

/// Everything `auto` needs to know about the layers and the machines.
#[derive(Debug, Clone)]
pub struct AutoInput<'a> {
    /// Forward + backward seconds per microbatch, per layer.
    pub layer_times: &'a [f64],
    /// Parameter bytes per layer (what the all-reduce moves).
    pub parameter_bytes: &'a [f64],
    /// Bytes crossing a cut after each layer, per microbatch (activation forward; the
    /// gradient of the same size goes back).
    pub cut_bytes: &'a [f64],
    /// Memory a stage needs per layer regardless of replication: weights, gradients,
    /// optimizer state and activations for the in-flight microbatches.
    pub memory_bytes: &'a [f64],
    pub machines: usize,
    pub machines_per_node: usize,
    pub memory_capacity: f64,
    pub microbatches: usize,
    /// (bandwidth B/s, latency s) inside a node and between nodes.
    pub intra: (f64, f64),
    pub inter: (f64, f64),
}

/// What `auto` chose.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoPlan {
    pub ranges: Vec<Range<usize>>,
    pub replicas: Vec<usize>,
    /// The bottleneck: predicted seconds per microbatch in steady state.
    pub time_per_microbatch: f64,
}

impl AutoPlan {
    pub fn notation(&self) -> String {
        self.replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
    }
}

fn ring(link: (f64, f64), p: usize, bytes: f64) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let p = p as f64;
    2.0 * (p - 1.0) * link.1 + 2.0 * (p - 1.0) / p * bytes / link.0
}

impl AutoInput<'_> {
    fn link_between(&self, a: usize, b: usize) -> (f64, f64) {
        let per = self.machines_per_node.max(1);
        if a / per == b / per {
            self.intra
        } else {
            self.inter
        }
    }

    /// The fewest replicas that make layers `i..j` (starting at machine `first`) run within
    /// `t`, or None. Also returns the stage's time.
    fn replicas_for(&self, p: &Prefixes, i: usize, j: usize, first: usize, t: f64) -> Option<(usize, f64)> {
        let compute = p.time[j] - p.time[i];
        if p.memory[j] - p.memory[i] > self.memory_capacity {
            return None;
        }
        let m = ((compute / t) - 1e-12).ceil().max(1.0) as usize;
        if m > self.machines {
            return None;
        }
        let level = self.link_between(first, first + m - 1);
        let sync = ring(level, m, p.weights[j] - p.weights[i]) / self.microbatches.max(1) as f64;
        let cut = if j < self.layer_times.len() {
            let link = self.link_between(first + m - 1, first + m);
            2.0 * (link.1 + self.cut_bytes[j - 1] / link.0)
        } else {
            0.0
        };
        let time = (compute / m as f64).max(sync).max(cut);
        (time <= t * (1.0 + 1e-12)).then_some((m, time))
    }

    /// Fewest machines reaching bottleneck `t`: (machines, ranges, replicas), or None.
    fn cover(&self, p: &Prefixes, t: f64) -> Option<(usize, Vec<(usize, usize)>)> {
        let n = self.layer_times.len();
        let mut fewest = vec![usize::MAX; n + 1];
        let mut from = vec![(0usize, 0usize); n + 1];
        fewest[0] = 0;
        for j in 1..=n {
            for i in 0..j {
                if fewest[i] == usize::MAX {
                    continue;
                }
                if let Some((m, _)) = self.replicas_for(p, i, j, fewest[i], t) {
                    let total = fewest[i] + m;
                    if total < fewest[j] {
                        fewest[j] = total;
                        from[j] = (i, m);
                    }
                }
            }
        }
        if fewest[n] > self.machines {
            return None;
        }
        let mut stages = Vec::new();
        let mut j = n;
        while j > 0 {
            let (i, m) = from[j];
            stages.push((i, m));
            j = i;
        }
        stages.reverse();
        Some((fewest[n], stages))
    }
}

/// PipeDream-style planning. Returns None when no layout fits in memory.
pub fn auto(input: &AutoInput<'_>) -> Option<AutoPlan> {
    let n = input.layer_times.len();
    if n == 0 || input.machines == 0 {
        return None;
    }
    let prefixes = Prefixes {
        time: prefix_sums(input.layer_times),
        weights: prefix_sums(input.parameter_bytes),
        memory: prefix_sums(input.memory_bytes),
    };
    // Bisection on the bottleneck time between a lower bound (perfect split over all
    // machines) and an upper bound that is always reachable if anything is.
    let total = prefixes.time[n];
    let mut lo = total / input.machines as f64 * 0.5;
    let mut hi = total.max(f64::MIN_POSITIVE);
    // Communication or sync may dominate: grow hi until feasible.
    let mut grow = 0;
    while input.cover(&prefixes, hi).is_none() {
        hi *= 2.0;
        grow += 1;
        if grow > 60 {
            return None;
        }
    }
    for _ in 0..64 {
        let mid = 0.5 * (lo + hi);
        if input.cover(&prefixes, mid).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
        if hi - lo <= hi * 1e-9 {
            break;
        }
    }
    let (_, stages) = input.cover(&prefixes, hi)?;
    let mut ranges = Vec::new();
    let mut replicas = Vec::new();
    let mut first = 0;
    let mut bottleneck: f64 = 0.0;
    for (k, &(i, m)) in stages.iter().enumerate() {
        let j = stages.get(k + 1).map(|s| s.0).unwrap_or(n);
        let (_, time) = input.replicas_for(&prefixes, i, j, first, hi)?;
        bottleneck = bottleneck.max(time);
        ranges.push(i..j);
        replicas.push(m);
        first += m;
    }
    Some(AutoPlan { ranges, replicas, time_per_microbatch: bottleneck })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every contiguous split into k non-empty ranges, by brute force.
    fn brute_force(times: &[f64], replicas: &[usize]) -> f64 {
        fn go(times: &[f64], replicas: &[usize], start: usize, stage: usize) -> f64 {
            let n = times.len();
            let k = replicas.len();
            if stage == k - 1 {
                return times[start..].iter().sum::<f64>() / replicas[stage] as f64;
            }
            let mut best = f64::INFINITY;
            for end in (start + 1)..=(n - (k - stage - 1)) {
                let here = times[start..end].iter().sum::<f64>() / replicas[stage] as f64;
                best = best.min(here.max(go(times, replicas, end, stage + 1)));
            }
            best
        }
        go(times, replicas, 0, 0)
    }

    proptest! {
        #[test]
        fn balanced_is_optimal_and_covers_every_layer_once(
            times in proptest::collection::vec(0.01f64..10.0, 1..12),
            replicas in proptest::collection::vec(1usize..4, 1..6),
        ) {
            prop_assume!(replicas.len() <= times.len());
            let (ranges, value) = balanced(&times, &replicas).expect("k <= n");
            // contiguous, non-empty, covering 0..n in order
            prop_assert_eq!(ranges.len(), replicas.len());
            prop_assert_eq!(ranges[0].start, 0);
            prop_assert_eq!(ranges.last().map(|r| r.end), Some(times.len()));
            for w in ranges.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            for r in &ranges {
                prop_assert!(r.start < r.end);
            }
            // the reported value is the real bottleneck of the ranges, and optimal
            let actual = ranges.iter().zip(&replicas).map(|(r, &m)| times[r.clone()].iter().sum::<f64>() / m as f64).fold(0.0f64, f64::max);
            prop_assert!((actual - value).abs() <= 1e-9 * value.max(1.0));
            let optimum = brute_force(&times, &replicas);
            prop_assert!((value - optimum).abs() <= 1e-9 * optimum.max(1.0), "dp {} vs brute force {}", value, optimum);
        }

        #[test]
        fn auto_uses_at_most_the_machines_and_covers_every_layer(
            times in proptest::collection::vec(0.01f64..10.0, 1..10),
            machines in 1usize..9,
        ) {
            let n = times.len();
            let zeros = vec![0.0; n];
            let input = AutoInput {
                layer_times: &times, parameter_bytes: &zeros, cut_bytes: &zeros, memory_bytes: &zeros,
                machines, machines_per_node: 4, memory_capacity: 1.0, microbatches: 8,
                intra: (1e12, 0.0), inter: (1e12, 0.0),
            };
            let plan = auto(&input).expect("free communication always plans");
            prop_assert!(plan.replicas.iter().sum::<usize>() <= machines);
            prop_assert_eq!(plan.ranges[0].start, 0);
            prop_assert_eq!(plan.ranges.last().map(|r| r.end), Some(n));
            for w in plan.ranges.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            // with free communication the bottleneck reaches the best contiguous split
            // into any number of stages with any replication, up to the bisection precision;
            // it can never beat total/machines
            let total: f64 = times.iter().sum();
            prop_assert!(plan.time_per_microbatch >= total / machines as f64 * (1.0 - 1e-9));
        }
    }

    #[test]
    fn auto_replicates_a_dominant_layer() {
        // one heavy layer without weights and three light ones with large weights on 4
        // machines: replicating the light layers would cost a slow all-reduce, so only the
        // heavy layer is replicated
        let times = [8.0, 1.0, 1.0, 1.0];
        let zeros = [0.0; 4];
        let params = [0.0, 1e10, 1e10, 1e10];
        let input = AutoInput {
            layer_times: &times,
            parameter_bytes: &params,
            cut_bytes: &zeros,
            memory_bytes: &zeros,
            machines: 4,
            machines_per_node: 4,
            memory_capacity: 1.0,
            microbatches: 8,
            intra: (1e9, 0.0),
            inter: (1e9, 0.0),
        };
        // "3-1" gives max(8/3, 3) = 3; "2-2", "2-1-1" or four single stages are slower
        let plan = auto(&input).expect("plans");
        assert_eq!(plan.notation(), "3-1");
        assert!((plan.time_per_microbatch - 3.0).abs() < 1e-6, "{}", plan.time_per_microbatch);
    }

    #[test]
    fn auto_respects_memory() {
        let times = [1.0, 1.0];
        let zeros = [0.0; 2];
        let memory = [0.6, 0.6];
        let input = AutoInput {
            layer_times: &times,
            parameter_bytes: &zeros,
            cut_bytes: &zeros,
            memory_bytes: &memory,
            machines: 2,
            machines_per_node: 2,
            memory_capacity: 1.0,
            microbatches: 4,
            intra: (1e12, 0.0),
            inter: (1e12, 0.0),
        };
        // both layers on one stage would need 1.2 > 1.0: two stages
        let plan = auto(&input).expect("plans");
        assert_eq!(plan.ranges.len(), 2);
        let mut input = input;
        input.machines = 1;
        assert!(auto(&input).is_none());
    }
}
