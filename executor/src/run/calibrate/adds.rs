//! The element-wise adds' bytes beyond the cache, fitted on the CPU's calibration.

use pipec_plan::device::DeviceModel;

use super::{fit, Calibration, Point};

/// The element-wise adds' bytes beyond the cache (`DeviceModel::memory_traffic`): where
/// the larger adds move their bytes slower than the line through all of them says (on this
/// 2-core machine, measured two at once, 61 GB/s up to 0.8 MB and 16–30 GB/s beyond, where
/// the one line gave 48 GB/s for all: the 12.6 MB add took 2.3 times its price), the adds
/// are split at each measured size: the line through those up to it, its bytes `cached`,
/// and the bandwidth beyond that makes the larger ones' times closest (relative least
/// squares). The split whose model is closest over every add is kept where it is closer
/// than the one line and its bandwidth beyond is the slower.
pub fn fit_memory_traffic(c: &mut Calibration) {
    let mut adds = c.adds.clone();
    adds.sort_by(|a, b| a.1.size.total_cmp(&b.1.size));
    let error = |d: &DeviceModel| {
        adds.iter().map(|(n, p)| ((d.vector_time(*n as f64, p.size) - p.seconds) / p.seconds.max(1e-12)).powi(2)).sum()
    };
    let mut best: (f64, Option<DeviceModel>) = (error(&c.device), None);
    // at least two adds on the line, one beyond it
    for k in 2..adds.len() {
        let within: Vec<(usize, Point)> = adds[..k].to_vec();
        let cached = within[k - 1].1.size;
        let line = fit(&c.device.name, c.device.memory, c.device.launch, &[], &within);
        let mut d = DeviceModel {
            memory_bandwidth: line.memory_bandwidth,
            memory_efficiency: line.memory_efficiency,
            memory_traffic: None,
            ..c.device.clone()
        };
        // the seconds per byte beyond `cached`, by weighted least squares on the larger adds
        let (mut num, mut den) = (0.0, 0.0);
        for (_, p) in &adds[k..] {
            // the launch and the bytes within the cache, on the line
            let base = d.launch + d.memory_time(cached.min(p.size));
            let (x, w) = (p.size - cached, 1.0 / (p.seconds * p.seconds).max(1e-24));
            num += w * x * (p.seconds - base);
            den += w * x * x;
        }
        if !(num > 0.0 && den > 0.0) {
            continue;
        }
        let bandwidth = den / num;
        if !(bandwidth.is_finite() && bandwidth < d.memory_bandwidth) {
            continue;
        }
        d.memory_traffic = Some(pipec_plan::device::Traffic::new(bandwidth, cached));
        let e = error(&d);
        if e < best.0 {
            best = (e, Some(d));
        }
    }
    if let Some(d) = best.1 {
        c.device = d;
    }
}
