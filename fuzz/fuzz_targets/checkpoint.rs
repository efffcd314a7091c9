//! Fuzz target: any bytes as a checkpoint — split into state.json, model.safetensors and
//! the optimizer files — through the reader `pipec run --resume` uses, and the MPI shard
//! decoder. Must never panic: a corrupt checkpoint is an error naming its file.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = pipec_plan::checkpoint::decode(data);
    // files separated by 0xFF 0x00 0xFF: state.json, model.safetensors, then optimizer files
    let parts: Vec<&[u8]> = split(data);
    let file = |name: &str| -> Result<Vec<u8>, String> {
        let i = match name {
            "state.json" => 0,
            "model.safetensors" => 1,
            other => 2 + other.bytes().filter(u8::is_ascii_digit).map(|b| usize::from(b - b'0')).sum::<usize>() % 4,
        };
        parts.get(i).map(|p| p.to_vec()).ok_or(format!("cannot read {name}"))
    };
    if let Ok(loaded) = pipec_plan::checkpoint::read_from(&file) {
        for (shape, values) in loaded.params.values() {
            assert!(values.iter().all(|v| v.is_finite()), "a non-finite value passed the reader");
            let _ = shape;
        }
    }
});

fn split(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 3 <= data.len() {
        if data[i..i + 3] == [0xFF, 0x00, 0xFF] {
            out.push(&data[start..i]);
            i += 3;
            start = i;
        } else {
            i += 1;
        }
    }
    out.push(&data[start..]);
    out
}
