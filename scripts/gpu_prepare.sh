#!/usr/bin/env bash
# Runs scripts/dev/gpu_prepare.sh (a GPU session's wheels and data into .gpu/) with the same arguments: the development
# tool lives under scripts/dev/, this path stays for the instructions that name it.
exec bash "$(dirname "$0")/dev/gpu_prepare.sh" "$@"
