//! Fuzz target: the nom parsers of the small languages (layer chains, quantities,
//! PipeDream notation, partition ranges) on arbitrary text. Must never panic, and error
//! offsets must stay inside the input.
#![no_main]
use libfuzzer_sys::fuzz_target;
use pipec_grammar::dsl;

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        for e in [
            dsl::parse_layer_item(s).err(),
            dsl::parse_chain(s).err(),
            dsl::parse_quantity(s).err(),
            dsl::parse_stages(s).err(),
            dsl::parse_range(s).err(),
        ]
        .into_iter()
        .flatten()
        {
            assert!(e.offset + e.len <= s.len());
        }
        if let Ok(item) = dsl::parse_layer_item(s) {
            for call in &item.chain {
                let _ = pipec_grammar::layers::resolve_call(call, Some(&[3, 8, 8]));
            }
        }
    }
});
