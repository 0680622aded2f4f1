#!/usr/bin/env bash
# tools/torch/libddp_capture.py on a plain PyTorch DDP script, and ddp-compare on its dumps
# (docs/compare.md, "Dumps from your own PyTorch script"; suite ddp).
#
#   tests/torch_capture.sh DDP_COMPARE SOURCE_ROOT
#
# tests/torch_capture_job.py (MLP, AdamW, 4 steps, 2 ranks on gloo, spawned by
# torch.multiprocessing) runs with the capture:
#  - the dump has the docs/dumps.md layout: meta.json (format, producer, world size, steps),
#    rank{r}/init.safetensors, step files, ddp.json with an initial and a rebuilt layout;
#    in every step file the averaged gradient is the float32 sum of the two ranks' local
#    gradients each divided by 2 (allreduce_hook), the same on both ranks, and the
#    "buckets" metadata names every parameter once;
#  - two runs of the same script: ddp-compare exits 0, layouts equal;
#  - the script's own hook scales bucket 1's averaged gradient by 0.999 at step 2:
#    ddp-compare exits 1 naming step 2, bucket 1, that bucket's first tensor, the ULPs, and
#    "only the averaged gradients differ (communication or hook)";
#  - rank 1's input changed at step 1: exit 1, "local gradients already differ (compute)"
#    at step 1, rank 1, and the input checksum that differs;
#  - gradient accumulation 2 under no_sync, a scheduler made after the Capture: two runs
#    agree, micro_batches is 2, no scheduler warning;
#  - a hook registered before the Capture: the capture refuses with its message.
# Skips (77) where /usr/bin/python3 has no torch.
set -u -o pipefail
compare=$1
src=$2
py=/usr/bin/python3
job=$src/tests/torch_capture_job.py
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() { echo "FAIL: $*"; exit 1; }
"$py" -c 'import torch' 2>/dev/null || { echo "SKIP: /usr/bin/python3 has no torch"; exit 77; }

run_job() { # dir args...
  local d=$1; shift
  timeout -k 5 120 "$py" "$job" "$work/$d" "$@" >"$work/$d.out" 2>&1 ||
    fail "torch_capture_job.py $d $* exited $?: $(tail -5 "$work/$d.out")"
}
run_job a
run_job b
run_job scaled --scale 2:1
run_job perturbed --perturb 1:1
run_job accum --accum 2
run_job accum2 --accum 2
grep -q "overridden" "$work/accum.out" && fail "scheduler warning: $(cat "$work/accum.out")"

# The layout, checked with tools/torch/safetensors.py (the capture itself does not use it).
"$py" - "$src/tools/torch" "$work/a" "$work/accum" <<'EOF' || fail "dump layout (above)"
import json, os, struct, sys
sys.path.insert(0, sys.argv[1])
import safetensors as st
d = sys.argv[2]
meta = json.load(open(os.path.join(d, "meta.json")))
assert meta["format"] == "libddp-dump-1" and meta["producer"] == "libddp_capture.py", meta
assert meta["world_size"] == 2 and meta["steps"] == 4, meta
assert meta["config"]["backend"] == "gloo" and meta["config"]["optim"] == "AdamW", meta
assert meta["config"]["script"] == "torch_capture_job.py", meta
names = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
for r in range(2):
    info = json.load(open(os.path.join(d, "rank%d" % r, "ddp.json")))
    assert info["param_names"] == names, info["param_names"]
    assert info["bucket_layouts"]["initial"] == [[0, 1, 2, 3, 4, 5]], info["bucket_layouts"]
    assert len(info["bucket_layouts"]["rebuilt"]) == 2, info["bucket_layouts"]
    init, _ = st.load(os.path.join(d, "rank%d" % r, "init.safetensors"))
    assert list(init) == ["param." + n for n in names], list(init)
f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]
for k in range(4):
    files = [st.load(os.path.join(d, "rank%d" % r, "step%06d.safetensors" % k)) for r in range(2)]
    (t0, m0), (t1, m1) = files
    buckets = json.loads(m0["buckets"])
    assert sorted(n for b in buckets for n in b) == sorted(names), buckets
    assert m0["step"] == str(k) and m1["rank"] == "1" and m0["micro_batches"] == "1", m0
    assert list(t0)[:2] == ["input_checksum.fwd0.args.0", "input_checksum.labels"], list(t0)
    for n in names:
        l0 = st.decode("F32", t0["local_grad." + n][2])
        l1 = st.decode("F32", t1["local_grad." + n][2])
        g0 = st.decode("F32", t0["grad." + n][2])
        assert g0 == st.decode("F32", t1["grad." + n][2]), (k, n, "ranks differ")
        want = [f32(f32(x / 2) + f32(y / 2)) for x, y in zip(l0, l1)]
        assert g0 == want, (k, n, "averaged gradient is not the ranks' mean")
        assert l0 != l1, (k, n, "both ranks have the same local gradient")
_, m = st.load(os.path.join(sys.argv[3], "rank1", "step000003.safetensors"))
assert m["micro_batches"] == "2", m
print("layout ok")
EOF

out=$("$compare" "$work/a" "$work/b") || fail "identical runs: exit $?: $out"
grep -q "result: within tolerance" <<<"$out" || fail "identical runs: $out"
grep -q "rank 1 initial equal, rebuilt equal" <<<"$out" || fail "layouts: $out"
out=$("$compare" "$work/accum" "$work/accum2") || fail "accumulation runs: exit $?: $out"

# The planted communication error: bucket 1's first parameter at step 2.
first=$("$py" - "$src/tools/torch" "$work/scaled/rank0/step000002.safetensors" <<'EOF'
import json, sys
sys.path.insert(0, sys.argv[1])
import safetensors as st
print(json.loads(st.load(sys.argv[2])[1]["buckets"])[1][0])
EOF
) || fail "cannot read the buckets of the scaled run"
out=$("$compare" "$work/a" "$work/scaled")
rc=$?
[ "$rc" = 1 ] || fail "scaled bucket: exit $rc (want 1): $out"
grep -q "first difference beyond tolerance: step 2, rank 0, bucket 1, tensor grad\.$first, index" \
  <<<"$out" || fail "scaled bucket: no step 2 / bucket 1 / grad.$first in: $out"
grep -q "ulps=[0-9]" <<<"$out" || fail "scaled bucket: no ULP distance: $out"
grep -q "diagnosis: step 2: only the averaged gradients differ (communication or hook), first in bucket 1; the local gradients agree" \
  <<<"$out" || fail "scaled bucket: not communication: $out"
json=$("$compare" --json "$work/a" "$work/scaled")
"$py" -c '
import json, sys
j = json.loads(sys.argv[1])
f, d = j["first_failure"], j["diagnosis"]
assert (f["step"], f["rank"], f["bucket"], f["tensor"]) == (2, 0, 1, "grad." + sys.argv[2]), f
assert abs(f["b"] / f["a"] - 0.999) < 1e-6 and f["ulps"] > 256, f
assert d["verdict"] == "averaged_gradients_differ", d
' "$json" "$first" || fail "scaled bucket JSON: $json"

# The planted compute difference: rank 1's input at step 1.
out=$("$compare" "$work/a" "$work/perturbed")
rc=$?
[ "$rc" = 1 ] || fail "changed input: exit $rc (want 1): $out"
grep -q "first difference beyond tolerance: step 1, " <<<"$out" || fail "changed input: $out"
grep -q "diagnosis: step 1: local gradients already differ (compute): first at step 1, rank 1, bucket 0, local_grad\." \
  <<<"$out" || fail "changed input: not compute at step 1, rank 1: $out"
grep -q "the inputs already differ at step 1, rank 1, input_checksum.fwd0.args.0" <<<"$out" ||
  fail "changed input: the input is not named: $out"

# A hook registered before the Capture is refused with the capture's message.
timeout -k 5 120 "$py" "$job" "$work/h" --hook_before >"$work/h.out" 2>&1
rc=$?
[ "$rc" = 3 ] || fail "hook before Capture: exit $rc (want 3): $(cat "$work/h.out")"
grep -q "create the Capture before ddp_model.register_comm_hook(state, hook)" "$work/h.out" ||
  fail "hook before Capture: $(cat "$work/h.out")"
echo "ok"
