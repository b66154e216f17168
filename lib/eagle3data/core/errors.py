"""The one base of the errors a user can fix: bad params, prompt files, run files, a server that refuses.

Each says in one line what is wrong and where (file, line, field). `python -m eagle3data ...`
maps every `UserInputError` to that line on stderr and exit status 2, in one place (`cli.main`);
`--debug` shows the traceback. Imports nothing of the project: every module may raise one.
"""

from __future__ import annotations


class UserInputError(Exception):
    """Input the user can fix; the message is one line naming the file, line and field."""

    status = 2
