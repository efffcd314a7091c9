//! Fuzz target: any bytes as a Hugging Face `config.json` → `pipec import`'s translation.
//! Must never panic; a spec it writes must check without errors.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&head, body)) = data.split_first() else { return };
    let seq = (head & 1 == 1).then_some(usize::from(head >> 1) + 1);
    let text = String::from_utf8_lossy(body);
    let cluster = pipec_grammar::import::hf::Target::default();
    if let Ok(imported) = pipec_grammar::import::hf::import(&text, "fuzz", seq, &cluster) {
        assert!(!pipec_grammar::check_source(&imported.spec).has_errors(), "{}", imported.spec);
    }
});
