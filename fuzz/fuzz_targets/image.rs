//! Fuzz target: any bytes as an image file (PNG, JPEG or neither) → the decoder and
//! transform an image folder's loader and `pipec check` share, for a crop and resize taken
//! from the first bytes. Must never panic; what it returns is the crop's values, finite.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_plan::images::{decode_bytes, Transform};

fuzz_target!(|data: &[u8]| {
    let [a, b, body @ ..] = data else { return };
    let c = if a & 1 == 1 { 3 } else { 1 };
    let side = usize::from(a >> 1 & 0x1f) + 1;
    let resize = (b & 1 == 1).then_some(usize::from(*b >> 1) + 1);
    let t = Transform { resize, mean: vec![0.5; c], std: vec![0.25; c] };
    if let Ok(v) = decode_bytes(body, "fuzz.png", [c, side, side], &t) {
        assert_eq!(v.len(), c * side * side);
        assert!(v.iter().all(|x| x.is_finite()));
    }
});
