# stub: replaced by the layout branch at merge
