#!/usr/bin/env bash
# Builds .gpu033fa3: the ComfyUI 0.33.0 GPU kit (../shared/gpu/kit-0.33) with FlashAttention-3's FP8 kernel (the
# fa3-fwd wheel from PyPI) in its site folder, for the rows that run the Compile node's attention 'fp8'. To fit one
# device call (64 MiB with the tracked files) it leaves out what no benchmark reads: the text encoders' tokenizer files,
# torchao's CUTLASS kernels (FluxAccel's FP8 GEMMs are torch._scaled_mm) and SQLAlchemy's compiled speed-ups (it runs
# without them), and strips the compiled modules' symbol tables. ~3 minutes on 2 cores. Then, on the device:
#   mkdir -p .gpu033 && cp .gpu033fa3/setup-on-device.sh .gpu033/ && KIT=.gpu033fa3 bash bench/device.sh ...
# (carry [".gpu033fa3"]).
set -euo pipefail
KIT_SRC=${KIT_SRC:-../shared/gpu/kit-0.33}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
xz -dc "$KIT_SRC/kit033.tar.xz" | tar -x -C "$work"
pip download --no-deps fa3-fwd==0.0.3 -d "$work/wheel" -q
python3 -m zipfile -e "$work"/wheel/fa3_fwd-*.whl "$work/site"
rm -rf "$work/site/test"
rm -f "$work"/site/torchao/_C_cutlass_90a.abi3.so "$work"/site/torchao/_C_mxfp8*.so
find "$work/site/sqlalchemy" -name "*_cy*.so" -delete
find "$work/ComfyUI/comfy/text_encoders" "$work/ComfyUI/comfy/sd1_tokenizer" -type f \( -name "*.json" -o -name "*.txt" -o -name "*.model" \) -size +200k -delete
# symbol tables only (what the loader reads, .dynsym, stays): the compiled modules and the libraries bundled with them
find "$work/site" -name "*.so*" -type f -exec strip --strip-unneeded {} + 2>/dev/null || true
mkdir -p .gpu033fa3
(cd "$work" && tar cf - site ComfyUI) | xz -9 -T2 > .gpu033fa3/kit033.tar.xz
cp "$KIT_SRC/setup-on-device.sh" .gpu033fa3/
grep -qx "/.gpu033fa3/" .git/info/exclude 2>/dev/null || echo "/.gpu033fa3/" >> .git/info/exclude
ls -l .gpu033fa3
