# shellcheck shell=bash
# Helpers shared by slurm/prolog and slurm/epilog (sourced, not executed).

# The staging root; same rule as hpcckpt.cluster.env.staging_root. A literal
# "%n" in it stands for the node name (several slurmd on one machine need that).
hooks_staging_root() {
    local pointer root=/tmp/hpcckpt-staging
    if [[ -n ${HPCCKPT_STAGING_ROOT:-} ]]; then
        root="$HPCCKPT_STAGING_ROOT"
    elif [[ -n ${SLURM_CONF:-} ]]; then
        pointer="$(dirname -- "$SLURM_CONF")/hpcckpt-staging-root"
        if [[ -r $pointer ]]; then
            root="$(head -n 1 -- "$pointer")"
        fi
    fi
    printf '%s\n' "${root//%n/${SLURMD_NODENAME:-$(hostname)}}"
}

# JSON string escaping in pure bash: the hooks must not depend on a Python on the node.
hooks_json_string() {
    local s="$1" out="" c i code
    local LC_ALL=C
    for ((i = 0; i < ${#s}; i++)); do
        c="${s:i:1}"
        case "$c" in
        '"') out+='\"' ;;
        "\\") out+="\\\\" ;;
        $'\n') out+='\n' ;;
        $'\r') out+='\r' ;;
        $'\t') out+='\t' ;;
        *)
            printf -v code '%d' "'$c"
            if ((code >= 0 && code < 32)) || ((code == 127)); then
                printf -v c '\\u%04x' "$code"
            fi
            out+="$c"
            ;;
        esac
    done
    printf '"%s"' "$out"
}

# hooks_record ROOT EVENT KEY VALUE [KEY VALUE]...: append one JSON line to
# ROOT/hooks.jsonl (node-local record of every prolog/epilog run).
hooks_record() {
    local root="$1" event="$2" line key
    shift 2
    line="{\"event\":$(hooks_json_string "$event"),\"time\":$(date +%s)"
    while (($# >= 2)); do
        key="$1"
        line+=",$(hooks_json_string "$key"):$(hooks_json_string "$2")"
        shift 2
    done
    line+="}"
    # One write(2) of a short line to an O_APPEND file does not interleave with
    # another node's or job's record.
    printf '%s\n' "$line" >>"$root/hooks.jsonl"
}

# The job's name as Slurm holds it (may contain anything but NUL); "" when unknown.
hooks_job_name() {
    local job_id="$1" text name
    text="$(scontrol show job -o -- "$job_id" 2>/dev/null)" || return 0
    [[ $text == *"JobName="* ]] || return 0
    name="${text#*JobName=}"
    # UserId= always follows JobName=; the shortest suffix match keeps a name that
    # itself contains " UserId=" whole.
    name="${name% UserId=*}"
    printf '%s' "$name"
}

# A field of `scontrol show job -o` that never holds free text (JobState, Reason...).
hooks_job_field() {
    local job_id="$1" key="$2" text value
    text="$(scontrol show job -o -- "$job_id" 2>/dev/null)" || return 0
    [[ $text == *" $key="* ]] || return 0
    value="${text##* "$key"=}"
    printf '%s' "${value%% *}"
}
