//! Fuzz target: any bytes as a `tokenizer.json` followed (after the first NUL) by text →
//! the tokenizer loader `pipec check` and the executor share, then encoding. Must never
//! panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (json, text) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b""[..]),
    };
    if let Ok(t) = pipec_plan::datafile::tokenizer_from_bytes(json, "fuzz.json") {
        let _ = t.encode(String::from_utf8_lossy(text).as_ref(), false);
    }
});
