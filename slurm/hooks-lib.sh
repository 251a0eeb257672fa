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

# hooks_dir_problem DIR [OWNER_UIDS]: prints why root must not write in DIR, nothing when
# it may. DIR must be a real directory owned by one of OWNER_UIDS (default: us, i.e.
# root in Slurm), and nobody else may rename entries in it: no group/other write
# unless the sticky bit is set (a shared 1777 directory like /tmp is fine).
hooks_dir_problem() {
    local dir="$1" owners="${2:-$EUID}" owner mode
    if [[ -L $dir ]]; then
        echo "it is a symbolic link"
        return 0
    fi
    if [[ ! -d $dir ]]; then
        echo "it is not a directory"
        return 0
    fi
    owner="$(stat -c %u -- "$dir")" || { echo "it cannot be read (stat failed)"; return 0; }
    mode="$(stat -c %a -- "$dir")" || { echo "it cannot be read (stat failed)"; return 0; }
    if [[ " $owners " != *" $owner "* ]]; then
        echo "it is owned by uid $owner, not by uid ${owners// / or uid }"
        return 0
    fi
    if (((8#$mode & 8#022) && !(8#$mode & 8#1000))); then
        echo "group or other users may write in it (mode $mode) and it has no sticky bit"
    fi
    return 0
}

# hooks_root_problem ROOT: hooks_dir_problem for the staging root itself (ours) and
# every directory above it (ours or root's): otherwise a user could swap a parent.
hooks_root_problem() {
    local root="$1" dir problem
    problem="$(hooks_dir_problem "$root")"
    if [[ -n $problem ]]; then
        printf '%s\n' "$problem"
        return 0
    fi
    dir="$(dirname -- "$root")"
    while [[ $dir != / && $dir != . ]]; do
        problem="$(hooks_dir_problem "$dir" "$EUID 0")"
        if [[ -n $problem ]]; then
            printf '%s\n' "its parent $dir is unsafe: $problem"
            return 0
        fi
        dir="$(dirname -- "$dir")"
    done
    return 0
}

# hooks_make_root ROOT: create the missing directories of ROOT (an absolute path), one at
# a time from the top, each only after its parent passed hooks_dir_problem: a symlink a
# user planted in a missing parent is refused before root creates anything under it
# (mkdir -p would follow it). Prints the problem, nothing when ROOT exists or was made.
hooks_make_root() {
    local root="$1" dir="" part problem
    local -a parts
    if [[ $root != /* ]]; then
        echo "it is not an absolute path"
        return 0
    fi
    IFS=/ read -r -a parts <<<"${root#/}"
    for part in "${parts[@]}"; do
        [[ -z $part || $part == . ]] && continue
        if [[ $part == .. ]]; then
            echo "it contains '..'"
            return 0
        fi
        problem="$(hooks_dir_problem "${dir:-/}" "$EUID 0")"
        if [[ -n $problem ]]; then
            printf '%s\n' "${dir:-/} is unsafe: $problem"
            return 0
        fi
        dir+="/$part"
        if [[ ! -e $dir && ! -L $dir ]]; then
            # Fails if anybody created the name meanwhile; the next round checks what is there.
            mkdir -m 0755 -- "$dir" 2>/dev/null
        fi
    done
    return 0
}

# hooks_log HOOK MESSAGE: one line on stderr (slurmd's log) and in syslog when it is there.
hooks_log() {
    echo "hpcckpt $1: $2" >&2
    command -v logger >/dev/null 2>&1 && logger -t "hpcckpt-$1" -- "$2" 2>/dev/null
    return 0
}

# JSON string escaping in pure bash: the hooks must not depend on a Python on the node.
# Valid UTF-8 passes through; a string that is not UTF-8 (Slurm takes any bytes as a
# job name) has each byte >= 0x80 written as \u00XX, so the line stays valid JSON.
hooks_json_string() {
    local s="$1" out="" c i code utf8=0
    local LC_ALL=C
    if printf '%s' "$s" | iconv -f UTF-8 -t UTF-8 >/dev/null 2>&1; then
        utf8=1
    fi
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
            ((code < 0)) && code=$((code + 256))
            if ((code < 32 || code == 127 || (code >= 128 && !utf8))); then
                printf -v c '\\u%04x' "$code"
            fi
            out+="$c"
            ;;
        esac
    done
    printf '"%s"' "$out"
}

# hooks_append HOOK FILE LINE: append LINE to FILE without ever following a symlink
# (O_NOFOLLOW) or blocking on a FIFO (O_NONBLOCK: a FIFO without a reader is refused at
# once, one with a reader takes the line and never stalls the hook), and only to a file
# of ours with one link. A missing file is created exclusively (O_EXCL, 0600): a name a
# user creates in a shared sticky root between the check and the open is refused, never
# written through. A file a user planted is logged and skipped: a hook never fails over it.
hooks_append() {
    local hook="$1" file="$2" line="$3" owner links conv=notrunc
    if [[ -L $file || (-e $file && ! -f $file) ]]; then
        hooks_log "$hook" "not writing to '$file': it is a symbolic link or not a regular file; remove it"
        return 0
    fi
    if [[ -e $file ]]; then
        owner="$(stat -c %u -- "$file")" links="$(stat -c %h -- "$file")"
        if [[ $owner != "$EUID" || $links != 1 ]]; then
            hooks_log "$hook" "not writing to '$file': owned by uid $owner with $links link(s), expected uid $EUID with 1; remove it"
            return 0
        fi
    else
        conv=notrunc,excl
    fi
    # One write(2) of the whole line (fullblock) to an O_APPEND file does not
    # interleave with another node's or job's record. Our own file, once there, cannot
    # be swapped: the root is ours and others may not write in it, or it is sticky.
    if ! printf '%s\n' "$line" | (umask 077 && exec timeout 10 dd of="$file" oflag=append,nofollow,nonblock \
        conv="$conv" bs=65536 iflag=fullblock status=none 2>/dev/null); then
        hooks_log "$hook" "could not append a record to '$file'"
    fi
    return 0
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
    hooks_append "$event" "$root/hooks.jsonl" "$line"
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
