"""What the command-line tools share: a `--help` that shows every option's default."""

from __future__ import annotations

import argparse
import copy


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`argparse`'s defaults formatter, also for options that have no help text (the
    stock one shows a default only beside a help text), and not twice where the help
    text already states it."""

    def _format_action(self, action):
        if action.option_strings and not (action.help and action.help.strip()) and action.help != argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = " "  # non-empty, so the default is appended and printed
        return super()._format_action(action)

    def _get_help_string(self, action):
        if "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)
