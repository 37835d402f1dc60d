# shellcheck shell=bash
# shellcheck disable=SC2154 # $cache and $start are the caller's (see "Needs" below)
# Sourced by build.sh, build-node.sh and build-metrics.sh: a build that never loses work.
# Each step writes into $cache/bin and stamps itself in $cache/stamps/<name> once it succeeds; a run
# after a failure or an interrupt skips the stamped steps and resumes at the first one without a stamp
# (Go's own build cache makes a half-done step cheap to redo). The caller writes $cache/.done after the
# last step: only then do the scripts print the bin directory without building.
# Needs: $cache, $start (SECONDS at the start) and log().

# step NAME COMMAND...: runs COMMAND unless NAME is stamped.
step() {
    local name=$1
    shift
    if [[ -f $cache/stamps/$name ]]; then
        log "$name: built by an earlier run ($(<"$cache/stamps/$name"))"
        return 0
    fi
    log "$name"
    "$@"
    mkdir -p "$cache/stamps"
    echo "seconds=$((SECONDS - start))" >"$cache/stamps/$name"
    log "  $name done after $((SECONDS - start))s"
}

# first_line COMMAND...: the first line of COMMAND's output (stdout and stderr), without a pipe into
# `head`, which under `set -o pipefail` can kill COMMAND with SIGPIPE and the script with it.
first_line() {
    local text
    text=$("$@" 2>&1)
    echo "${text%%$'\n'*}"
}
