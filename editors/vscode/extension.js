// Starts `pipec lsp` for spec files. The YAML extension (redhat.vscode-yaml) adds schema
// completion through the yamlValidation contribution in package.json.
const vscode = require("vscode");
const { LanguageClient } = require("vscode-languageclient/node");

let client;

function activate(context) {
  const config = vscode.workspace.getConfiguration("pipec");
  const command = config.get("path", "pipec");
  const patterns = config.get("files", ["**/*.pipec.yaml", "**/specs/*.yaml"]);
  client = new LanguageClient(
    "pipec",
    "pipec",
    { command, args: ["lsp"] },
    { documentSelector: patterns.map((pattern) => ({ scheme: "file", language: "yaml", pattern })) }
  );
  client.start();
  context.subscriptions.push({ dispose: () => client && client.stop() });
}

function deactivate() {
  return client ? client.stop() : undefined;
}

module.exports = { activate, deactivate };
