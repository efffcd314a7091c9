"""`pipec lsp` driven by an independent client: pytest-lsp (pygls' client), with the
capability sets it records from real editors (VS Code and Neovim)."""

import os
import pathlib
import random

import pytest
import pytest_lsp
from lsprotocol import types
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

ROOT = pathlib.Path(__file__).resolve().parents[2]
PIPEC = os.environ.get("PIPEC_BIN") or str(
    pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "pipec"
)


@pytest_lsp.fixture(
    config=ClientServerConfig(server_command=[PIPEC, "lsp"]),
    params=["visual_studio_code", "neovim"],
)
async def client(request, lsp_client: LanguageClient):
    params = types.InitializeParams(capabilities=client_capabilities(request.param))
    result = await lsp_client.initialize_session(params)
    assert result.capabilities.hover_provider
    yield
    await lsp_client.shutdown_session()


def uri_of(name: str) -> str:
    return (ROOT / name).as_uri()


async def open_doc(client: LanguageClient, name: str, text: str, version: int = 1):
    client.text_document_did_open(
        types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri_of(name), language_id="yaml", version=version, text=text)
        )
    )
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    return client.diagnostics[uri_of(name)]


async def actions_on(client: LanguageClient, name: str, diagnostics):
    """The code actions offered on the first of `diagnostics`."""
    return await client.text_document_code_action_async(
        types.CodeActionParams(
            text_document=types.TextDocumentIdentifier(uri=uri_of(name)),
            range=diagnostics[0].range,
            context=types.CodeActionContext(diagnostics=diagnostics),
        )
    )


async def test_diagnostics_have_codes_and_utf16_ranges(client: LanguageClient):
    text = (ROOT / "specs/invalid/many-errors.yaml").read_text()
    diags = await open_doc(client, "specs/invalid/many-errors.yaml", text)
    codes = sorted(d.code for d in diags)
    assert codes == ["E0102", "E0103", "E0201", "E0304"]
    unknown = next(d for d in diags if d.code == "E0102")
    # `# expect: E0102 24:3` in the file is 1-based; LSP is 0-based
    assert unknown.range.start == types.Position(line=23, character=2)
    assert unknown.range.end == types.Position(line=23, character=12)
    assert unknown.source == "pipec"
    assert "did you mean `microbatches`" in unknown.message
    shape = next(d for d in diags if d.code == "E0304")
    assert shape.related_information, "the secondary label arrives as related information"


async def test_diagnostics_update_on_change(client: LanguageClient):
    name = "specs/invalid/unknown-key-strategy.yaml"
    text = (ROOT / name).read_text()
    diags = await open_doc(client, name, text)
    assert [d.code for d in diags] == ["E0102"]
    fixed = text.replace("  microbatch: 4", "  microbatches: 4")
    client.text_document_did_change(
        types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri_of(name), version=2),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=fixed)],
        )
    )
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    assert list(client.diagnostics[uri_of(name)]) == []


async def test_quick_fix_for_a_misspelt_key(client: LanguageClient):
    name = "specs/invalid/unknown-key-strategy.yaml"
    diags = await open_doc(client, name, (ROOT / name).read_text())
    actions = await client.text_document_code_action_async(
        types.CodeActionParams(
            text_document=types.TextDocumentIdentifier(uri=uri_of(name)),
            range=diags[0].range,
            context=types.CodeActionContext(diagnostics=list(diags)),
        )
    )
    assert actions and actions[0].title == "replace with `microbatches`"
    edit = actions[0].edit.changes[uri_of(name)][0]
    assert edit.new_text == "microbatches" and edit.range == diags[0].range


async def test_quick_fix_picks_a_microbatch_count_that_meets_every_constraint(client: LanguageClient):
    # chimera on two pipeline pairs with 6 microbatches: the fix rewrites the microbatches
    # value (not the schedule the diagnostic points at) to 8, which divides the batch of 48
    # and is a multiple of 2 x 2; the cursor on either place offers it
    name = "specs/invalid/chimera-replicated-microbatches.yaml"
    text = (ROOT / name).read_text()
    diags = await open_doc(client, name, text)
    assert [d.code for d in diags] == ["E0405"]
    line = next(i for i, l in enumerate(text.splitlines()) if l.startswith("  microbatches:"))
    value = types.Range(start=types.Position(line=line, character=16), end=types.Position(line=line, character=17))
    for where in (diags[0].range, value):
        actions = await client.text_document_code_action_async(
            types.CodeActionParams(
                text_document=types.TextDocumentIdentifier(uri=uri_of(name)),
                range=where,
                context=types.CodeActionContext(diagnostics=list(diags)),
            )
        )
        assert [a.title for a in actions] == ["use 8 microbatches"]
        edit = actions[0].edit.changes[uri_of(name)][0]
        assert edit.new_text == "8" and edit.range == value


async def test_hover_on_layers_keys_and_strategy(client: LanguageClient):
    name = "specs/pipedream-2-1-1.yaml"
    text = (ROOT / name).read_text()
    await open_doc(client, name, text)
    lines = text.splitlines()

    def pos(needle: str, shift: int = 1) -> types.Position:
        for i, line in enumerate(lines):
            if needle in line:
                return types.Position(line=i, character=line.index(needle) + shift)
        raise AssertionError(needle)

    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=uri_of(name)), position=pos("linear"))
    )
    assert "linear(in, out, bias=true, tie=NAME)" in hover.contents.value
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=uri_of(name)), position=pos("microbatches"))
    )
    assert "global batch" in hover.contents.value
    # the background compile finishes after a pause in typing: the strategy's hover then
    # also carries the plan's prediction
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=uri_of(name)), position=pos('stages: "2-1-1"', 10))
    )
    assert "3 stage(s) using 4 worker(s)" in hover.contents.value
    assert "predicted step" in hover.contents.value
    # on the schedule: its description, the prediction, and the other schedules side by side
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=uri_of(name)), position=pos("schedule: ", 11))
    )
    value = hover.contents.value
    assert "predicted step" in value and "Other schedules (predicted)" in value, value
    for schedule in ("`gpipe`", "`1f1b`", "`zb-h1`"):
        assert schedule in value, value
    # 2-1-1 replicates a stage unevenly: interleaved, ZBV and Chimera do not apply
    assert "Not applicable here:" in value and "`chimera`" in value.split("Not applicable here:")[1], value


async def test_completion_of_keys_values_and_layers(client: LanguageClient):
    name = "scratch.pipec.yaml"
    text = "model:\n  layers:\n    - lin\nstrategy:\n  schedule: zb\n  \n"
    await open_doc(client, name, text)

    async def complete(line: int, character: int):
        result = await client.text_document_completion_async(
            types.CompletionParams(
                text_document=types.TextDocumentIdentifier(uri=uri_of(name)),
                position=types.Position(line=line, character=character),
            )
        )
        items = result.items if hasattr(result, "items") else result
        return [i.label for i in items]

    assert await complete(2, 9) == ["linear"]
    assert set(await complete(4, 14)) == {"zb-h1", "zbv"}
    keys = await complete(5, 2)
    assert "microbatches" in keys and "schedule" not in keys


async def test_plan_level_diagnostics_arrive_off_the_typing_path(client: LanguageClient):
    name = "tests/specs/too-big.yaml"
    diags = await open_doc(client, name, (ROOT / name).read_text())
    assert list(diags) == [], "the front end finds nothing wrong"
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    codes = [d.code for d in client.diagnostics[uri_of(name)]]
    assert "E0601" in codes


async def test_strategy_auto_is_searched_and_offered_as_a_code_action(client: LanguageClient):
    # the background compile searches the strategy; its choice arrives as W0606, whose
    # code action writes the chosen strategy into the spec
    name = "specs/auto.yaml"
    text = (ROOT / name).read_text()
    diags = await open_doc(client, name, text)
    assert list(diags) == [], "the front end finds nothing wrong"
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    chosen = [d for d in client.diagnostics[uri_of(name)] if d.code == "W0606"]
    assert chosen and "the search chose" in chosen[0].message, client.diagnostics[uri_of(name)]
    actions = await actions_on(client, name, chosen)
    assert [a.title for a in actions] == ["write the chosen strategy into the spec"]
    edit = actions[0].edit.changes[uri_of(name)][0]
    # a layout written out, or PipeDream's planner's (`partition: auto`, no stages)
    layout = "stages: " in edit.new_text or "partition: auto" in edit.new_text
    assert edit.new_text.startswith("{ ") and "schedule: " in edit.new_text and layout, edit.new_text


PRECISION_AUTO = """name: l8b
engine: megatron
model:
  input: [8192]
  layers:
    - embedding(128256, 4096)
    - repeat 32: transformer_block(d=4096, heads=32, ff=14336, causal=true, kv_heads=8, norm=rmsnorm, mlp=swiglu, rope=500000, bias=false)
    - rmsnorm
    - linear(4096, 128256, bias=false)
  loss: cross_entropy
  attention: flash
cluster:
  nodes: 1
  devices_per_node: 8
  device: h100-sxm
  links: dgx-h100
strategy: { tp: auto, pp: auto, dp: auto, schedule: auto, microbatches: auto, recompute: auto }
training:
  batch_size: 32
  steps: 1
  optimizer: { kind: adamw, lr: 0.0003 }
  precision: auto
"""


async def test_a_searched_precision_is_written_with_the_strategy_by_one_code_action(client: LanguageClient):
    # `precision: auto`: the search's choice is two edits, the strategy and the precision
    name = "specs/precision-auto-scratch.yaml"
    diags = await open_doc(client, name, PRECISION_AUTO)
    assert list(diags) == [], "the front end finds nothing wrong"
    await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    chosen = [d for d in client.diagnostics[uri_of(name)] if d.code == "W0606"]
    assert chosen, client.diagnostics[uri_of(name)]
    actions = await actions_on(client, name, chosen)
    assert [a.title for a in actions] == ["write the chosen strategy and precision into the spec"]
    edits = actions[0].edit.changes[uri_of(name)]
    assert len(edits) == 2, edits
    strategy, precision = edits
    assert strategy.range.start.line == 16 and strategy.new_text.startswith("{ "), strategy
    assert precision.range.start.line == 21 and precision.new_text in ("bf16", "fp8"), precision


async def test_a_stream_of_random_edits_never_breaks_the_server(client: LanguageClient):
    name = "specs/hybrid.yaml"
    text = (ROOT / name).read_text()
    await open_doc(client, name, text)
    rng = random.Random(7)
    alphabet = "abz019:-[]{}\"' \n\t#&*!|>%µé"
    version = 1
    for _ in range(300):
        version += 1
        i = rng.randrange(len(text) + 1)
        if rng.random() < 0.5 and text:
            text = text[:i] + text[i + rng.randrange(1, 6):]
        else:
            text = text[:i] + "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))) + text[i:]
        client.text_document_did_change(
            types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uri_of(name), version=version),
                content_changes=[types.TextDocumentContentChangeWholeDocument(text=text)],
            )
        )
    # the server is alive and answers for the final text
    hover = await client.text_document_hover_async(
        types.HoverParams(text_document=types.TextDocumentIdentifier(uri=uri_of(name)), position=types.Position(line=0, character=0))
    )
    assert hover is None or hover.contents is not None
    version += 1
    final = (ROOT / "specs/invalid/bad-loss.yaml").read_text()
    client.text_document_did_change(
        types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri_of(name), version=version),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=final)],
        )
    )
    for _ in range(400):
        await client.wait_for_notification(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
        if [d.code for d in client.diagnostics[uri_of(name)]] == ["E0105"]:
            break
    assert [d.code for d in client.diagnostics[uri_of(name)]] == ["E0105"]
