#!/usr/bin/env bash
# Builds static/vendor/plotly.min.js: plotly.js with only the trace types our charts draw
# (scatter lines and markers, bar, heatmap, parcoords), about a third of the full bundle.
# The version is the one the `plotly` Python package ships (its figures' JSON is made for it).
# Needs node and npm against the registry; nothing is left in the repository but the file.
#
#   bash .ci/plotly-bundle.sh            # rebuild after an upgrade of plotly, or a new trace type
set -euo pipefail
cd "$(dirname "$0")/.."
out="$PWD/static/vendor/plotly.min.js"
version="$(.venv/bin/python -c 'import plotly.offline as o; print(o.get_plotlyjs_version())')"
traces="bar heatmap parcoords"  # scatter is in plotly.js's core
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent "plotly.js@$version" >/dev/null
tar xzf "plotly.js-$version.tgz"
cd package
npm install --omit=dev --ignore-scripts --no-audit --no-fund --silent
npm install --no-save --ignore-scripts --no-audit --no-fund --silent \
    esbuild esbuild-plugin-environment esbuild-plugin-glsl esbuild-plugin-inline-css stream-browserify
{
    echo "var Plotly = require('./core');"
    echo "Plotly.register(["
    for t in $traces; do echo "    require('./$t'),"; done
    echo "]);"
    echo "module.exports = Plotly;"
} >lib/index-suanli.js
# plotly.js's own esbuild settings (esbuild-config.js), minified, as a global `Plotly`.
cat >build-suanli.js <<JS
require("esbuild").build({
    entryPoints: ["./lib/index-suanli.js"], outfile: process.argv[2],
    format: "iife", globalName: "Plotly", bundle: true, minify: true, legalComments: "none",
    banner: { js: "/* plotly.js v$version (MIT licence, Plotly, Inc.), a partial bundle: scatter $traces. Built by .ci/plotly-bundle.sh */" },
    plugins: [require("esbuild-plugin-inline-css")(), require("esbuild-plugin-glsl").glsl({ minify: true }),
              require("esbuild-plugin-environment").environmentPlugin({ NODE_DEBUG: false })],
    alias: { regl: "@plotly/regl", stream: "stream-browserify" },
    define: { global: "window", "define.amd": "false" }, target: "es2016", logLevel: "warning",
}).catch(() => process.exit(1));
JS
node build-suanli.js "$out"
echo "$out: $(wc -c <"$out") bytes (plotly.js $version: scatter $traces)"
