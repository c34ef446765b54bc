"""reports: render tracelens analysis tables into self-contained HTML (plotly), Markdown and JSON.

May import: tracelens, plotly, jinja2.
"""
