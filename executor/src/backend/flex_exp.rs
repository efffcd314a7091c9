//! The exponential, the logistic and the normal distribution of `f32` slices on the CPU, as
//! straight-line arithmetic the compiler vectorizes: the CPU kernels' exponentials
//! (attention's softmax, the cross-entropy, SwiGLU's logistic, GELU's distribution and its
//! tanh approximation).
//!
//! `f32::exp` is a call into `libm` per value, which no loop around it vectorizes, and
//! SwiGLU's logistic branched on the sign of each value: `specs/llama-tiny.yaml`'s
//! `pipec profile` spent 12% of its samples in `libm`'s `expf` and 10% in the gated unit's
//! kernels, whose gradient ran 1.6 times its forward in the block where the calibration
//! measured them equal (branch mispredictions on the gate's signs; docs/benchmarks.md).
//!
//! [`exp`] reduces x = k·ln 2 + r with |r| ≤ ln 2 / 2 (ln 2 in two parts, so k·ln 2 is exact
//! for every k it meets) and evaluates e^r as 1 + r + r²·P(r), P of degree 5 (Taylor's
//! coefficients up to r⁷/7! fitted to the interval, as Cephes' `expf` does; within 1 ulp of
//! `libm` for every `f32` of the range, checked once on 2026-12-07, a grid of it tested),
//! then scales by 2^k through the exponent bits. Below
//! [`EXP_UNDERFLOW`] (e^x under the smallest normal `f32`) it is 0. The same operations run
//! in every lane whatever the vector width, with no fused multiply-adds, so the results are
//! the same on every x86-64 and every layout of a plan computes the same bits.
//!
//! The slice functions run on AVX2 where the CPU has it (checked once at run time; 8 lanes)
//! and on the baseline's SSE2 (4 lanes) elsewhere.
#![allow(unsafe_code)]

/// Below this e^x is about `f32`'s smallest normal (2^-126 is e^-87.3365): [`exp`] gives 0
/// (the true value is at most 1.2e-38, nothing beside a softmax's largest term of 1 or a
/// logistic's 1). From here up the scaled e^r stays a normal number.
pub(crate) const EXP_UNDERFLOW: f32 = -87.33;
/// Above this e^x overflows `f32`: [`exp`] gives e^88.72, the largest it represents (a
/// logistic of −88.72 or less is then 2.9e-39, as good as its true value).
const EXP_OVERFLOW: f32 = 88.722_83;

/// e^x for one value (see the module's note); inlined into the loops that vectorize it.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // 1.5·2^23: adding it rounds x·log2(e) to an integer k kept in the low mantissa bits
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let c = x.clamp(EXP_UNDERFLOW, EXP_OVERFLOW);
    let shifted = c * std::f32::consts::LOG2_E + ROUND;
    let k = shifted - ROUND;
    let r = c - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * (r * r) + r + 1.0;
    // 2^k added to e^r's exponent field: k from the rounding's low bits, −126 ≤ k ≤ 128
    let k_bits = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let y = f32::from_bits((er.to_bits() as i32).wrapping_add(k_bits << 23) as u32);
    if x < EXP_UNDERFLOW {
        0.0
    } else if x.is_nan() {
        // a NaN stays one (its bits through the scaling above would not): a diverged
        // value is never made finite
        x
    } else {
        y
    }
}

/// The logistic 1/(1 + e^−x).
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// The standard normal distribution Φ(x) = erfc(−x/√2)/2, from erfc(a) = t·e^(−a² + P(t)),
/// t = 1/(1 + a/2) for a = |x|/√2 ≥ 0 and P the degree-9 Chebyshev fit of Press et al.,
/// *Numerical Recipes* (2nd ed., §6.2, `erfcc`: erfc's relative error under 1.2e-7), and
/// Φ(x) = 1 − erfc(a)/2 for x ≥ 0. GELU's x·Φ(x) is within 3.7e-7 of its `f64` value over
/// [−12, 12] (under one `f32` ulp of the value; on a grid of 2^-8, tested), where `flex`'s
/// 0.5·x·(1 + erf(x/√2)) with `libm`'s `erff` is within 4.5e-7 (a grid of 2^-12,
/// 2026-12-07).
#[inline(always)]
pub(crate) fn normal_cdf(x: f32) -> f32 {
    let a = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * a);
    let mut p = 0.170_872_77f32;
    for c in [
        -0.822_152_23,
        1.488_515_9,
        -1.135_204,
        0.278_868_07,
        -0.186_288_06,
        0.096_784_18,
        0.374_091_96,
        1.000_023_7,
        -1.265_512_2,
    ] {
        p = p * t + c;
    }
    let half_erfc = 0.5 * t * exp(p - a * a);
    if x >= 0.0 {
        1.0 - half_erfc
    } else {
        half_erfc
    }
}

/// The standard normal density φ(x) = e^(−x²/2)/√(2π).
#[inline(always)]
pub(crate) fn normal_pdf(x: f32) -> f32 {
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    INV_SQRT_2PI * exp(-0.5 * x * x)
}

/// GELU's derivative Φ(x) + x·φ(x).
#[inline(always)]
fn gelu_slope(x: f32) -> f32 {
    normal_cdf(x) + x * normal_pdf(x)
}

/// GELU's tanh approximation's σ(2u) = 0.5·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³),
/// and its slope σ(2u) + x·σ(2u)·(1 − σ(2u))·2u′ (no cancellation near 0, as 1 + tanh had).
#[inline(always)]
fn tanh_gelu_parts(x: f32) -> (f32, f32) {
    const SQRT_2_OVER_PI: f32 = crate::backend::gelu::SQRT_2_OVER_PI as f32;
    const CUBIC: f32 = crate::backend::gelu::CUBIC as f32;
    let x2 = x * x;
    let s = sigmoid(2.0 * SQRT_2_OVER_PI * (x + CUBIC * x * x2));
    let du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * x2);
    (s, s + x * s * (1.0 - s) * du)
}

/// Runs `body` compiled for AVX2 where the CPU has it, for the baseline elsewhere: `body`
/// is generic and inlined into both, so each is its own vectorized copy.
macro_rules! vectorized {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        pub(crate) fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn wide($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU was just found to have AVX2, the only feature `wide`
                    // is compiled for
                    return unsafe { wide($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

/// Lanes of the reductions below: their partial results, combined in lane order at the end
/// (the same order whatever the vector width).
const LANES: usize = 8;

/// Σ f(a[i], b[i]) over the shorter of the two: 8 running sums, each of every eighth term,
/// added in lane order, then the rest left to right. Not the left-to-right sum's last bits,
/// but the same on every CPU and every call.
#[inline(always)]
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let n = a.len().min(b.len());
    let whole = n - n % LANES;
    let mut lanes = [0f32; LANES];
    for (x, y) in a[..whole].chunks_exact(LANES).zip(b[..whole].chunks_exact(LANES)) {
        for i in 0..LANES {
            lanes[i] += f(x[i], y[i]);
        }
    }
    let head = lanes.iter().fold(0f32, |s, &l| s + l);
    a[whole..n].iter().zip(&b[whole..n]).fold(head, |s, (&x, &y)| s + f(x, y))
}

vectorized! {
    /// The largest of `values` (−∞ for none; a NaN is passed over, as `f32::max` does):
    /// 8 running maxima, then theirs; the maximum is the same in any order.
    fn max(values: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let chunks = values.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for i in 0..LANES {
                lanes[i] = lanes[i].max(c[i]);
            }
        }
        rest.iter().fold(lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max), |m, &v| m.max(v))
    }
}

vectorized! {
    /// Σ a[i] in [`lane_sum`]'s order.
    fn sum(a: &[f32]) -> f32 {
        lane_sum(a, a, |x, _| x)
    }
}

vectorized! {
    /// Σ a[i]·b[i] over the shorter, in [`lane_sum`]'s order.
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        lane_sum(a, b, |x, y| x * y)
    }
}

vectorized! {
    /// Each value v made e^(v − shift), or 0 where v − shift is below `zero` (a masked
    /// score).
    fn exp_shifted(values: &mut [f32], shift: f32, zero: f32) {
        for v in values.iter_mut() {
            let x = *v - shift;
            *v = if x < zero { 0.0 } else { exp(x) };
        }
    }
}

vectorized! {
    /// SwiGLU's forward over one row: `out[i] = g[i]·σ(g[i])·u[i]`; over the shortest.
    fn silu_gated(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n = g.len().min(u.len()).min(out.len());
        let (g, u, out) = (&g[..n], &u[..n], &mut out[..n]);
        for i in 0..n {
            out[i] = g[i] * sigmoid(g[i]) * u[i];
        }
    }
}

vectorized! {
    /// SwiGLU's gradient over one row from its output's gradient `dy`: with s = σ(g) and
    /// t = dy·u, the gate's `t·s + t·g·s·(1 − s)` and the up's `g·s·dy` (in the order Burn's
    /// autodiff multiplies them); over the shortest.
    fn silu_gated_grad(g: &[f32], u: &[f32], dy: &[f32], d_gate: &mut [f32], d_up: &mut [f32]) {
        let n = g.len().min(u.len()).min(dy.len()).min(d_gate.len()).min(d_up.len());
        let (g, u, dy, d_gate, d_up) = (&g[..n], &u[..n], &dy[..n], &mut d_gate[..n], &mut d_up[..n]);
        for i in 0..n {
            let s = sigmoid(g[i]);
            let t = dy[i] * u[i];
            d_gate[i] = t * s + t * g[i] * s * (1.0 - s);
            d_up[i] = g[i] * s * dy[i];
        }
    }
}

vectorized! {
    /// GELU (exact: x·Φ(x)) of each value of `x`; over the shorter of the two.
    fn gelu(x: &[f32], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        for i in 0..n {
            out[i] = x[i] * normal_cdf(x[i]);
        }
    }
}

vectorized! {
    /// GELU's gradient from its output's gradient: `dy·(Φ(x) + x·φ(x))`; over the shortest.
    fn gelu_grad(x: &[f32], dy: &[f32], out: &mut [f32]) {
        let n = x.len().min(dy.len()).min(out.len());
        let (x, dy, out) = (&x[..n], &dy[..n], &mut out[..n]);
        for i in 0..n {
            out[i] = dy[i] * gelu_slope(x[i]);
        }
    }
}

vectorized! {
    /// GELU's tanh approximation x·σ(2u) of each value of `x`; over the shorter of the two.
    fn gelu_tanh(x: &[f32], out: &mut [f32]) {
        let n = x.len().min(out.len());
        let (x, out) = (&x[..n], &mut out[..n]);
        for i in 0..n {
            out[i] = x[i] * tanh_gelu_parts(x[i]).0;
        }
    }
}

vectorized! {
    /// The tanh approximation's gradient from its output's gradient `dy`; over the
    /// shortest.
    fn gelu_tanh_grad(x: &[f32], dy: &[f32], out: &mut [f32]) {
        let n = x.len().min(dy.len()).min(out.len());
        let (x, dy, out) = (&x[..n], &dy[..n], &mut out[..n]);
        for i in 0..n {
            out[i] = dy[i] * tanh_gelu_parts(x[i]).1;
        }
    }
}

vectorized! {
    /// GEGLU's forward over one row: `out[i] = g[i]·Φ(g[i])·u[i]`; over the shortest.
    fn gelu_gated(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n = g.len().min(u.len()).min(out.len());
        let (g, u, out) = (&g[..n], &u[..n], &mut out[..n]);
        for i in 0..n {
            out[i] = g[i] * normal_cdf(g[i]) * u[i];
        }
    }
}

vectorized! {
    /// GEGLU's gradient over one row from its output's gradient `dy`: the gate's
    /// `(dy·u)·(Φ(g) + g·φ(g))`, the up's `g·Φ(g)·dy`; over the shortest.
    fn gelu_gated_grad(g: &[f32], u: &[f32], dy: &[f32], d_gate: &mut [f32], d_up: &mut [f32]) {
        let n = g.len().min(u.len()).min(dy.len()).min(d_gate.len()).min(d_up.len());
        let (g, u, dy, d_gate, d_up) = (&g[..n], &u[..n], &dy[..n], &mut d_gate[..n], &mut d_up[..n]);
        for i in 0..n {
            d_gate[i] = dy[i] * u[i] * gelu_slope(g[i]);
            d_up[i] = g[i] * normal_cdf(g[i]) * dy[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between two finite `f32` of one sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_one_ulp_of_libm_over_its_range() {
        let mut worst = (0, 0.0f32);
        let mut x = EXP_UNDERFLOW;
        while x < EXP_OVERFLOW {
            let d = ulps(exp(x), x.exp());
            if d > worst.0 {
                worst = (d, x);
            }
            x += 1.0e-3;
        }
        assert!(worst.0 <= 1, "{} ulp at {}", worst.0, worst.1);
        assert_eq!(exp(0.0), 1.0);
        assert!(ulps(exp(1.0), std::f32::consts::E) <= 1);
    }

    #[test]
    fn the_lane_reductions_are_the_maximum_and_the_lane_ordered_sums() {
        let x: Vec<f32> = (0..203).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
        let y: Vec<f32> = (0..203).map(|i| (i as f32 * 0.21).cos()).collect();
        for n in [0, 1, 7, 8, 9, 64, 203] {
            let (x, y) = (&x[..n], &y[..n]);
            assert_eq!(max(x), x.iter().copied().fold(f32::NEG_INFINITY, f32::max), "{n}");
            // the order the module states, written out: lane i sums every eighth term
            let whole = n - n % LANES;
            let in_lanes = |f: &dyn Fn(usize) -> f32| {
                let lanes: Vec<f32> =
                    (0..LANES).map(|l| (l..whole).step_by(LANES).fold(0f32, |s, i| s + f(i))).collect();
                (whole..n).fold(lanes.iter().fold(0f32, |s, &v| s + v), |s, i| s + f(i))
            };
            assert_eq!(dot(x, y).to_bits(), in_lanes(&|i| x[i] * y[i]).to_bits(), "{n}");
            assert_eq!(sum(x).to_bits(), in_lanes(&|i| x[i]).to_bits(), "{n}");
            let exact: f64 = x.iter().zip(y).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            assert!((f64::from(dot(x, y)) - exact).abs() < 1e-4, "{n}");
        }
        assert_eq!(max(&[1.0, f32::NAN, 3.0]), 3.0);
    }

    #[test]
    fn a_nan_stays_a_nan_through_every_function() {
        let nan = f32::NAN;
        assert!(exp(nan).is_nan() && sigmoid(nan).is_nan() && normal_cdf(nan).is_nan());
        assert!(gelu_slope(nan).is_nan() && tanh_gelu_parts(nan).0.is_nan() && tanh_gelu_parts(nan).1.is_nan());
        let (x, mut out) = ([1.0, nan, -3.0, nan, 0.5, 2.0, nan, 7.0, nan], [0.0f32; 9]);
        let mut shifted = x;
        exp_shifted(&mut shifted, 0.5, EXP_UNDERFLOW);
        let nans = |v: &[f32]| v.iter().map(|v| v.is_nan()).collect::<Vec<_>>();
        let expected = nans(&x);
        assert_eq!(nans(&shifted), expected);
        gelu(&x, &mut out);
        assert_eq!(nans(&out), expected);
        gelu_tanh(&x, &mut out);
        assert_eq!(nans(&out), expected);
        silu_gated(&x, &x, &mut out);
        assert_eq!(nans(&out), expected);
    }

    #[test]
    fn exp_is_zero_below_the_smallest_normal_and_finite_above_the_largest() {
        assert_eq!(exp(-87.4), 0.0);
        assert_eq!(exp(-1.0e9), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(EXP_UNDERFLOW) > 0.0 && exp(EXP_UNDERFLOW).is_normal());
        assert!(exp(1.0e9).is_finite() && exp(100.0) >= exp(88.0));
        assert_eq!(sigmoid(-1.0e9), 1.0 / (1.0 + exp(1.0e9)));
        assert_eq!(sigmoid(1.0e9), 1.0);
    }

    /// Φ(x) in `f64` from erfc's continued fraction and series (Abramowitz and Stegun 7.1.5
    /// and 7.1.14, summed far past `f32`'s precision).
    fn normal_cdf_f64(x: f64) -> f64 {
        let z = x.abs() / std::f64::consts::SQRT_2;
        let erfc = if z < 3.0 {
            // erf(z) = 2/√π Σ (−1)^n z^(2n+1) / (n! (2n+1))
            let (mut term, mut sum) = (z, z);
            for n in 1..200 {
                term *= -z * z / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            1.0 - 2.0 / std::f64::consts::PI.sqrt() * sum
        } else {
            // erfc(z) = e^(−z²)/√π · 1/(z + (1/2)/(z + 1/(z + (3/2)/(z + ...))))
            let mut f = z;
            for k in (1..200).rev() {
                f = z + (k as f64 / 2.0) / f;
            }
            (-z * z).exp() / std::f64::consts::PI.sqrt() / f
        };
        if x >= 0.0 {
            1.0 - erfc / 2.0
        } else {
            erfc / 2.0
        }
    }

    #[test]
    fn gelu_and_its_slope_are_within_4e_7_of_their_f64_values() {
        let (mut worst_gelu, mut worst_relative, mut worst_slope) = (0f64, 0f64, 0f64);
        for i in -12 * 256..=12 * 256 {
            let x = i as f32 / 256.0;
            let (xf, cdf) = (f64::from(x), normal_cdf_f64(f64::from(x)));
            let gelu = xf * cdf;
            let off = (f64::from(x * normal_cdf(x)) - gelu).abs();
            worst_gelu = worst_gelu.max(off);
            // in the negative tail e^(−x²/2) in f32 carries x²'s rounding: GELU of −7 (−9e-12)
            // is 4.5e-6 off relative
            if gelu.abs() > 1e-12 {
                worst_relative = worst_relative.max(off / gelu.abs());
            }
            let slope = cdf + xf * (-0.5 * xf * xf).exp() / (2.0 * std::f64::consts::PI).sqrt();
            worst_slope = worst_slope.max((f64::from(gelu_slope(x)) - slope).abs());
        }
        assert!(worst_gelu < 4e-7, "GELU off by {worst_gelu:e}");
        assert!(worst_relative < 5e-6, "GELU off by {worst_relative:e} relative");
        assert!(worst_slope < 4e-7, "GELU's slope off by {worst_slope:e}");
        assert_eq!(normal_cdf(0.0), 0.5);
        assert_eq!(normal_cdf(-1.0e9), 0.0);
        assert_eq!(normal_cdf(1.0e9), 1.0);
    }

    #[test]
    fn the_slices_wide_and_narrow_give_the_same_bits_as_one_value_at_a_time() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
        let u: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = x.clone();
        exp_shifted(&mut out, 2.5, -20.0);
        for (o, &x) in out.iter().zip(&x) {
            let v = x - 2.5;
            assert_eq!(o.to_bits(), if v < -20.0 { 0.0f32 } else { exp(v) }.to_bits());
        }
        silu_gated(&x, &u, &mut out);
        for ((o, &g), &u) in out.iter().zip(&x).zip(&u) {
            assert_eq!(o.to_bits(), (g * sigmoid(g) * u).to_bits());
        }
        let (mut dg, mut du) = (vec![0.0; 1003], vec![0.0; 1003]);
        silu_gated_grad(&x, &u, &u, &mut dg, &mut du);
        for i in 0..1003 {
            let (g, s, t) = (x[i], sigmoid(x[i]), u[i] * u[i]);
            assert_eq!(dg[i].to_bits(), (t * s + t * g * s * (1.0 - s)).to_bits());
            assert_eq!(du[i].to_bits(), (g * s * u[i]).to_bits());
        }
        gelu(&x, &mut out);
        for (o, &x) in out.iter().zip(&x) {
            assert_eq!(o.to_bits(), (x * normal_cdf(x)).to_bits());
        }
        gelu_grad(&x, &u, &mut out);
        for ((o, &x), &dy) in out.iter().zip(&x).zip(&u) {
            assert_eq!(o.to_bits(), (dy * gelu_slope(x)).to_bits());
        }
        gelu_tanh(&x, &mut out);
        for (o, &x) in out.iter().zip(&x) {
            assert_eq!(o.to_bits(), (x * tanh_gelu_parts(x).0).to_bits());
        }
        gelu_tanh_grad(&x, &u, &mut out);
        for ((o, &x), &dy) in out.iter().zip(&x).zip(&u) {
            assert_eq!(o.to_bits(), (dy * tanh_gelu_parts(x).1).to_bits());
        }
        gelu_gated(&x, &u, &mut out);
        for ((o, &g), &u) in out.iter().zip(&x).zip(&u) {
            assert_eq!(o.to_bits(), (g * normal_cdf(g) * u).to_bits());
        }
        gelu_gated_grad(&x, &u, &u, &mut dg, &mut du);
        for i in 0..1003 {
            let (g, u) = (x[i], u[i]);
            assert_eq!(dg[i].to_bits(), (u * u * gelu_slope(g)).to_bits());
            assert_eq!(du[i].to_bits(), (g * normal_cdf(g) * u).to_bits());
        }
    }
}
