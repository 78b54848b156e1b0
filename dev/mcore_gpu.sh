# Source on the GPU machine (from the project root) before driving Megatron-core there: unpacks the
# staged trees and einops carried as .anchors/mcore.tar.xz (dev/README.md says how to pack it) into
# /tmp/mcore, and sets MCORE (the PR 3828 merge), MCORE_DEV and PYTHONPATH.
mkdir -p /tmp/mcore && tar -xJf .anchors/mcore.tar.xz -C /tmp/mcore
export MCORE=/tmp/mcore/megatron-core/m3828 MCORE_DEV=/tmp/mcore/megatron-core/dev
export PYTHONPATH=/tmp/mcore/pylib${PYTHONPATH:+:$PYTHONPATH}
