# Sourced first thing in a device command: `source tools/device/declare_commit.sh <commit>` (the commit that
# `git rev-parse HEAD` names here, typed into the command). The device's copy of the working tree carries a .git
# that is not this checkout's (it names an older commit), so a run there records that commit with git_dirty=true
# and `lora-lab publish` refuses it (session 17: notebook 07's run of f1916d3's code was unpublishable). This moves
# that .git out of the tree and declares the commit through $LORA_LAB_SOURCE_COMMIT instead (lora_lab.lab.provenance:
# git_state's "declared" source); publish still checks that the run's code and notebook hashes are the tree's.
if [ -z "${1:-}" ]; then echo "declare_commit.sh: give the commit (git rev-parse HEAD here)" >&2; return 2; fi
# the full 40-digit hash, pasted from `git rev-parse HEAD`: a typed short prefix can be wrong and still look right
# (session 18 declared 4467ddf1 for 4467ddf2…); `lora-lab publish` refuses a commit the repository does not have
if ! [[ "$1" =~ ^[0-9a-f]{40}$ ]]; then
  echo "declare_commit.sh: give the full 40-digit commit (git rev-parse HEAD here), not '$1'" >&2; return 2
fi
if [ -d .git ]; then mv .git /tmp/stale-device-git.$$; fi
export LORA_LAB_SOURCE_COMMIT=$1
echo "declared commit $LORA_LAB_SOURCE_COMMIT (the copy's own .git moved to /tmp)"
