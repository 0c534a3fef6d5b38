"""What stands on specexec.py and offload.py (nothing below imports it):

cli.py      the command line, `python specexec.py`: flags, loading, streaming, the summary
chat.py     a conversation: specexec_app.chat.Chat (the API) and --chat
plots.py    the notebook's pictures
"""
